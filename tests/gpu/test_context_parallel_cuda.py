"""Context parallelism on CUDA: PyTorch's ring attention through offloadkit, two ranks (on
one GPU when only one is present), against the single-process step (and four ranks where four GPUs are); alone and with
checkpointing, offloaded block inputs, the chunked loss and the tiled MLP; and with the
attention outputs kept for the recompute (ring attention hands back DTensors)."""

import os

import pytest
import torch

from tests.torchrun import GPU_ENV, torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
WORKER = os.path.join(os.path.dirname(__file__), "dist", "cp_worker.py")


@pytest.mark.parametrize("variant", ["plain", "stack", "kept"])
def test_two_ranks_match_the_single_process_step(variant):
    proc = torchrun(WORKER, variant, timeout=240, env=GPU_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("RESULT cp") == 2, proc.stdout[-2000:]


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("variant", ["stack", "kept"])
def test_four_ranks_match_the_single_process_step(variant):
    # Four ranks: each holds 2 of 8 chunks, and the ring takes three turns instead of one.
    proc = torchrun(WORKER, variant, nproc=4, timeout=300, env=GPU_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("RESULT cp") == 4, proc.stdout[-2000:]
