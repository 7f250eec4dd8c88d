"""Updates in backward under data parallelism on two GPUs (NCCL): DDP's communication hook
updates each bucket on a side stream after its all-reduce, FSDP2 updates the reduce-scattered
shards on its post-reduce stream (also through the Trainer's own FSDP2, with checkpoint
inputs offloaded), context parallelism all-reduces before each update; every
result bitwise ``torch.optim`` under the same wrapper (deterministic kernels) and the
replicas equal across ranks. The worker is the CPU suite's, run on CUDA."""

import os

import pytest
import torch

from tests.torchrun import GPU_ENV, assert_ranks_reported, torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

WORKER = os.path.join(os.path.dirname(__file__), "..", "cpu", "dist", "update_worker.py")
CHECKS = {
    "ddp": ["ddp-adamw", "ddp-sgd", "ddp-bucket-view", "ddp-clip", "ddp-accumulate", "ddp-unused", "ddp-unsaid"],
    "fsdp2": ["fsdp2-adamw", "fsdp2-sgd", "fsdp2-clip", "fsdp2-accumulate-accumulating", "fsdp2-accumulate-no-sync"],
    "cp": ["cp-adamw", "cp-clip"],
    "trainer_fsdp2": ["trainer-fsdp2", "trainer-fsdp2-accumulate"],
}


@pytest.mark.parametrize("route", sorted(CHECKS))
def test_updates_in_backward_apply_the_reduced_gradient_on_two_gpus(route):
    env = {"OFFLOADKIT_TEST_DEVICE": "cuda", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", **GPU_ENV}
    assert_ranks_reported(torchrun(WORKER, route, env=env), CHECKS[route])


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("route", sorted(CHECKS))
def test_updates_in_backward_apply_the_reduced_gradient_on_four_gpus(route):
    env = {"OFFLOADKIT_TEST_DEVICE": "cuda", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", **GPU_ENV}
    assert_ranks_reported(torchrun(WORKER, route, nproc=4, timeout=420, env=env), CHECKS[route], ranks=4)
