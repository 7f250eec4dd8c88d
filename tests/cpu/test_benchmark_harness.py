"""The trainer cells of the compatibility matrix (``benchmarks/compat_trainers.py``) run on a
CPU as a dry run: the Trainer's loops (gradient accumulation, evaluation with
compute_metrics, both checkpointing kinds, saving and resuming, generate() afterwards) train
bitwise equal without and with the mixin, and a run that differs is reported as such."""

import argparse
import os
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("trl")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import compat_trainers  # noqa: E402


def test_the_trainer_loops_cells_are_bitwise():
    rows = compat_trainers.cells_loops(argparse.Namespace(seq_len=64))
    assert len(rows) == 3
    for row in rows:
        assert row["status"] == "works", row
        assert row["parity"].startswith("bitwise"), row
    assert "generate() after training gives the same tokens" in rows[0]["note"]


def test_a_run_that_differs_is_reported():
    logged = [{"loss": 1.0}] * compat_trainers.STEPS
    same = {
        "logged": logged,
        "weights": {},
        "report": {},
        "peak_gib": 1.0,
        "step_s": 1.0,
        "steps_s": [],
        "peaks_gib": [],
    }
    other = dict(same, logged=[{"loss": 1.5}] + logged[1:])
    assert compat_trainers._compare("cell", same, same)["parity"].startswith("bitwise")
    assert compat_trainers._compare("cell", same, other)["parity"] == "DIFFERS"


def test_the_optimizer_precision_curve_runs_and_reports_each_precision(tmp_path):
    """``benchmarks/optimizer_precision.py`` as a dry run: three precisions on the same data,
    the host state each keeps, and a report whose fp32_master row has no gap to itself."""
    from benchmarks import optimizer_precision as op

    args = argparse.Namespace(
        shape="tiny",
        steps=6,
        batch=2,
        seq_len=64,
        lr=3e-3,
        warmup=2,
        device="cpu",
        device_name="cpu",
        corpus="stdlib",
        corpus_bytes=200_000,
        corpus_tokens=200_000,
        corpus_blocks=3000,
    )
    # A corpus the run does not repeat: Python's own sources, as on the GPU.
    texts = op.corpus(args)
    assert sum(len(t) for t in texts) >= 200_000 and all(isinstance(t, str) for t in texts)
    records = [op.run(name, args) for name in op.PRECISIONS]
    bytes_per_param = {r["precision"]: r["host_state_bytes_per_param"] for r in records}
    assert bytes_per_param == {"params": 4.0, "compact": 4.0, "fp32_master": 12.0}
    first = {r["losses"][0] for r in records}
    assert len(first) == 1  # the same model and batch before any update
    assert all(len(r["losses"]) == 6 and r["losses"][-1] < r["losses"][0] for r in records)
    text = op.report(records, args)
    assert "| fp32_master | 12.0 |" in text and "+0.0000 | +0.0000 |" in text
    assert "Corpus: stdlib (200,000 tokens" in text


def test_the_full_fine_tune_comparison_does_not_start_a_peer_the_host_cannot_hold(monkeypatch):
    """``benchmarks/full_ft_peers.py`` checks a mode's host state against the RAM available
    before starting it (a host out of memory takes the machine down), and its table reports
    such a mode as not run, with the reason, beside the measured ones."""
    from benchmarks import full_ft_peers as peers

    monkeypatch.setattr(peers, "_available_host_bytes", lambda: 100 << 30)
    args = argparse.Namespace(seq_len=16384, layers=2)
    record = peers.run_one("deepspeed_zero2_offload", "llama-3-8b", args)
    assert "step_s" not in record and record["host_state_gib"] > 119
    assert "needs 120 GiB (16 bytes a parameter)" in record["skipped"] and "100 GiB available" in record["skipped"]
    measured = dict(
        mode="offloadkit", shape="llama-3-8b", seq_len=16384, step_s=2.0, tokens_per_s=8192.0, losses=[12.0],
        peak_allocated_gib=20.0, peak_reserved_gib=22.0, host_peak_rss_gib=95.0, optimizer="BackwardAdamW",
    )  # fmt: skip
    slower = dict(measured, mode="fsdp2_cpu_offload", step_s=5.0)
    text = peers._table([measured, slower, record], "# head")
    assert "| llama-3-8b | fsdp2_cpu_offload | 16384 | 5.00 | 8192 | 2.50x |" in text
    assert "| llama-3-8b | deepspeed_zero2_offload | 16384 | - |" in text and "not run: its host state needs" in text
