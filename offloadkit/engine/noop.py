"""Opting a region out of offloading."""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["NoOpManager"]


def _keep(t: torch.Tensor) -> torch.Tensor:
    # A detached alias, not the tensor itself: returning an output tensor from a pack hook
    # forms a cycle (tensor -> grad_fn -> saved -> tensor) that leaks the graph when no
    # backward runs. Autograd restores grad_fn / requires_grad on unpack.
    return t.detach()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


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
        super().__init__(_keep, _identity)
