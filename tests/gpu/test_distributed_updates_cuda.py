"""Updates in backward under data parallelism on two GPUs (NCCL): DDP's communication hook
updates each bucket on a side stream after its all-reduce, FSDP2 updates the reduce-scattered
shards on its post-reduce stream, context parallelism all-reduces before each update; every
result bitwise ``torch.optim`` under the same wrapper (deterministic kernels) and the
replicas equal across ranks. The worker is the CPU suite's, run on CUDA."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

WORKER = os.path.join(os.path.dirname(__file__), "..", "cpu", "dist", "update_worker.py")
CHECKS = {
    "ddp": ["ddp-adamw", "ddp-sgd", "ddp-bucket-view", "ddp-clip", "ddp-accumulate", "ddp-unused", "ddp-unsaid"],
    "fsdp2": ["fsdp2-adamw", "fsdp2-sgd", "fsdp2-clip"],
    "cp": ["cp-adamw", "cp-clip"],
}


@pytest.mark.parametrize("route", sorted(CHECKS))
def test_updates_in_backward_apply_the_reduced_gradient_on_two_gpus(route):
    env = dict(
        os.environ,
        PYTHONPATH=os.getcwd(),
        OFFLOADKIT_TEST_DEVICE="cuda",
        CUBLAS_WORKSPACE_CONFIG=":4096:8",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", WORKER, route],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for check in CHECKS[route]:
        assert proc.stdout.count(f"RESULT {check} ") == 2, (check, proc.stdout[-2000:])
