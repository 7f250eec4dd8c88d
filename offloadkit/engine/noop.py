"""Opting a region out of offloading."""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import saved_tensors_hooks

from offloadkit.engine.spans import Kept

__all__ = ["NoOpManager"]


def _keep(t: torch.Tensor) -> Kept:
    # A detached alias, not the tensor itself: returning an output tensor from a pack hook
    # forms a cycle (tensor -> grad_fn -> saved -> tensor) that leaks the graph when no
    # backward runs. The alias carries the version it had, so in-place writes after the
    # save still raise autograd's error. Autograd restores grad_fn / requires_grad on unpack.
    return Kept(t)


def _unpack(kept: Kept) -> torch.Tensor:
    return kept.unpack()


class NoOpManager(saved_tensors_hooks, contextlib.ContextDecorator):
    """Saved-tensor hooks that keep tensors where they are.

    Entered inside an :class:`~offloadkit.OffloadActivations` region, it opts the inner
    region out: only the innermost hooks run.

    Example:
        >>> with OffloadActivations():
        ...     h = body(x)
        ...     with NoOpManager():
        ...         logits = head(h)  # stays on the device
    """

    def __init__(self) -> None:
        super().__init__(_keep, _unpack)
