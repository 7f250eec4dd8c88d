"""The trainer cells of the compatibility matrix on the GPU, as ``pytest``: DoRA and
``modules_to_save`` through TRL's SFTTrainer, and the Trainer's loops (gradient accumulation,
evaluation with compute_metrics, both checkpointing kinds, saving and resuming, generate()
afterwards), each without and with the mixin: every logged value and the trained weights
bitwise equal, and offloading lowers the peak where it offloads everything.
``benchmarks/compat_trainers.py`` is the same code at 2048 tokens, with the timings."""

import argparse
import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("peft")
pytest.importorskip("trl")
pytest.importorskip("datasets")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import compat_trainers  # noqa: E402

ARGS = argparse.Namespace(seq_len=512)


def _all_bitwise(rows):
    assert rows
    for row in rows:
        assert row["status"] == "works", row
        assert row["parity"].startswith("bitwise"), row


def test_peft_variants_through_sft_trainer_are_bitwise():
    rows = compat_trainers.cells_peft(ARGS)
    _all_bitwise(rows)
    offload_all = [r for r in rows if ": offload all" in r["cell"]]
    assert offload_all and all(r["peak_with_gib"] < r["peak_without_gib"] for r in offload_all)


def test_trainer_loops_are_bitwise():
    _all_bitwise(compat_trainers.cells_loops(ARGS))
