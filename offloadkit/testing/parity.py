"""Bitwise comparison of a training step with and without a memory-saving context."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

__all__ = ["run_step", "grads_of", "assert_bitwise_equal", "assert_equal_as_reruns"]


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_step(model, batch: dict, ctx=None, loss_fn: Callable | None = None) -> tuple[torch.Tensor, dict]:
    """One forward+backward from zero grads; returns (loss, grads)."""
    model.zero_grad(set_to_none=True)
    with ctx if ctx is not None else contextlib.nullcontext():
        out = model(**batch)
        loss = loss_fn(out, batch) if loss_fn is not None else out.loss
    loss.backward()
    return loss.detach().clone(), grads_of(model)


def assert_bitwise_equal(a, b, what: str = "") -> None:
    """Exact equality (NaN-aware, dtype and shape checked) of tensors or dicts of tensors."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what}: different keys {set(a) ^ set(b)}"
        assert len(a) > 0, f"{what}: nothing to compare"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{what}[{k}]")
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    same = torch.equal(a, b) or bool(
        torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())
    )
    if not same:
        diff = (a.float() - b.float()).abs().max().item()
        raise AssertionError(f"{what}: not bitwise equal (max abs diff {diff:g})")


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def assert_equal_as_reruns(ref: dict, ref_again: dict, got: dict, what: str = "", factor: float = 4.0) -> str:
    """``got`` bitwise equal to ``ref`` when ``ref`` reproduces itself bitwise (``ref_again``,
    the same run repeated); otherwise no further from ``ref`` than ``factor`` times the
    run-to-run spread. Kernels that accumulate with atomics (the query gradient of CUDA's
    attention backward, whose order varies from run to run) leave the second case.

    Returns:
        "bitwise" or "within the run-to-run spread": what was asserted.
    """
    assert ref.keys() == ref_again.keys() == got.keys(), f"{what}: different keys"
    spread = _max_diff(ref, ref_again)
    if spread == 0:
        assert_bitwise_equal(ref, got, what)
        return "bitwise"
    diff = _max_diff(ref, got)
    assert diff <= factor * spread, f"{what}: max abs diff {diff:g} beyond {factor} x the rerun spread {spread:g}"
    return "within the run-to-run spread"
