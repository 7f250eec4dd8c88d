"""Whether the forward running now is a checkpoint's recompute, whose output nothing reads.

A non-reentrant checkpoint runs its function twice: in forward, where the output goes on to
the rest of the model, and in backward, where only what the function saves is kept and the
output is dropped. :func:`discarding_recompute` wraps a checkpointed function so that its
second call runs under :func:`output_discarded`, which also records the checkpointed module
(the unit). Only the unit's own output is dropped: inside a unit of several layers, one
layer's output feeds the next. A module whose output is only ever combined by ops that save
nothing before its layer returns (a decoder layer's MLP before the residual add) may skip the
work that only produces that output where its layer is the unit being recomputed and no
forward hook reads the output (``longctx/tiled_mlp.py``).

A replay of dropped block inputs runs blocks forward in backward whose outputs *are* read
(each feeds the next block): those first calls are not marked.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

from torch import nn
from torch.nn.modules import module as _module

__all__ = [
    "discarding_recompute",
    "output_discarded",
    "output_hooked",
    "output_read",
    "recomputing",
    "recomputing_for_saves",
]

_local = threading.local()
_READ = object()  # the mark of a forward nested in a recompute whose output is read


def _units() -> list:
    """This thread's stack of open recomputes: the unit of each (None: unknown, or read)."""
    if not hasattr(_local, "units"):
        _local.units = []
    return _local.units


def recomputing_for_saves() -> bool:
    """True inside a checkpoint's recompute (on this thread), where the output is dropped."""
    units = _units()
    return bool(units) and units[-1] is not _READ


def recomputing(unit: nn.Module) -> bool:
    """True inside a checkpoint's recompute of exactly ``unit``'s forward (on this thread):
    ``unit``'s output is dropped. False inside a larger unit, where it feeds what follows."""
    units = _units()
    return bool(units) and units[-1] is unit


@contextlib.contextmanager
def output_discarded(unit: nn.Module | None = None):
    """Mark the forward run inside as one whose output nothing reads: ``unit``'s (the
    checkpointed module's; None where it is not known)."""
    units = _units()
    units.append(unit)
    try:
        yield
    finally:
        units.pop()


@contextlib.contextmanager
def output_read():
    """Clear the mark inside (a forward nested in a recompute whose output is read)."""
    units = _units()
    units.append(_READ)
    try:
        yield
    finally:
        units.pop()


def output_hooked(module: nn.Module) -> bool:
    """Whether a forward hook would see ``module``'s output: one of its own, or a global one
    (``register_module_forward_hook``). Pre-hooks see only the inputs."""
    return bool(module._forward_hooks) or bool(_module._global_forward_hooks)


def discarding_recompute(fn: Callable, unit: nn.Module | None = None) -> Callable:
    """``fn`` for one checkpoint call of ``unit`` (the checkpointed module, whose forward
    ``fn`` is): its first call (the forward) runs as it is, every later call (the checkpoint's
    recompute) under :func:`output_discarded`."""
    calls = 0

    def run(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            with output_read():  # a block replayed in backward: its output feeds the next one
                return fn(*args, **kwargs)
        with output_discarded(unit):
            return fn(*args, **kwargs)

    return run
