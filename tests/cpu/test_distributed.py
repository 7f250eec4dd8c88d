"""Two ranks on CPU (gloo) under torchrun: DDP and FSDP2 with offloading give the results of
the run without it; a failing rank ends the whole run with its error, without hanging; layer
streaming refuses weights FSDP2 owns."""

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")

WORKER = os.path.join(os.path.dirname(__file__), "dist", "worker.py")


def torchrun(mode, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", WORKER, mode],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return proc, time.monotonic() - start


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_match_the_run_without_offloading(mode):
    proc, _ = torchrun(mode)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count(f"RESULT {mode}") == 2


def test_a_failing_rank_ends_the_run_with_its_error():
    proc, seconds = torchrun("fail", timeout=180)
    assert proc.returncode != 0
    assert "rank 1 failed in its forward" in proc.stderr
    assert "RESULT fail" not in proc.stdout
    assert seconds < 150, "the surviving rank must not hang"


def test_layer_streaming_refuses_fsdp2_weights():
    proc, _ = torchrun("stream_fsdp2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("CPUOffloadPolicy") == 2


def test_context_parallel_on_two_ranks_adds_up_to_the_single_process_step():
    proc, _ = torchrun("cp")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("RESULT cp") == 2
