"""Two ranks on CPU (gloo) under torchrun: DDP and FSDP2 with offloading give the results of
the run without it; a failing rank ends the whole run with its error, without hanging; layer
streaming refuses weights FSDP2 owns."""

import os
import sys
import time

import pytest

from tests.torchrun import torchrun

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")

WORKER = os.path.join(os.path.dirname(__file__), "dist", "worker.py")


def launch(mode, timeout=240):
    start = time.monotonic()
    proc = torchrun(WORKER, mode, timeout=timeout)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_match_the_run_without_offloading(mode):
    proc, _ = launch(mode)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count(f"RESULT {mode}") == 2


def test_a_failing_rank_ends_the_run_with_its_error():
    proc, seconds = launch("fail", timeout=180)
    assert proc.returncode != 0
    assert "rank 1 failed in its forward" in proc.stderr
    assert "RESULT fail" not in proc.stdout
    assert seconds < 150, "the surviving rank must not hang"


def test_layer_streaming_refuses_fsdp2_weights():
    proc, _ = launch("stream_fsdp2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("CPUOffloadPolicy") == 2


def test_context_parallel_on_two_ranks_adds_up_to_the_single_process_step():
    proc, _ = launch("cp")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("RESULT cp") == 2
