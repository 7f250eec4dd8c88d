"""Two hosts of two GPUs each, simulated on a machine of four: two ``torchrun`` launchers
(``--nnodes 2``, a rendezvous on localhost), each given two GPUs, its own spill directory and
its own RAM budget; DDP over NCCL with block inputs going to each host's disk gives the
single-process step. The worker is the CPU suite's, run on CUDA."""

import pytest
import torch

from tests.cpu.test_multinode import run_two_hosts
from tests.torchrun import GPU_ENV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs 4 GPUs"),
]


def test_four_gpus_as_two_hosts_with_their_own_budgets_and_directories(tmp_path):
    def host_env(node):
        gpus = f"{2 * node},{2 * node + 1}"
        return {"OFFLOADKIT_TEST_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": gpus, **GPU_ENV}

    run_two_hosts(tmp_path, host_env)
