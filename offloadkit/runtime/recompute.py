"""Whether the forward running now is a checkpoint's recompute, whose output nothing reads.

A non-reentrant checkpoint runs its function twice: in forward, where the output goes on to
the rest of the model, and in backward, where only what the function saves is kept and the
output is dropped. :func:`discarding_recompute` wraps a checkpointed function so that its
second call runs under :func:`output_discarded`; a module whose output is only ever combined
by ops that save nothing (a decoder layer's MLP before the residual add) may then skip the
work that only produces that output (``longctx/tiled_mlp.py``).

A replay of dropped block inputs runs blocks forward in backward whose outputs *are* read
(each feeds the next block): those first calls are not marked.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

__all__ = ["discarding_recompute", "output_discarded", "output_read", "recomputing_for_saves"]

_local = threading.local()


def recomputing_for_saves() -> bool:
    """True inside a checkpoint's recompute (on this thread), where the output is dropped."""
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def output_discarded():
    """Mark the forward run inside as one whose output nothing reads."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


@contextlib.contextmanager
def output_read():
    """Clear the mark inside (a forward nested in a recompute whose output is read)."""
    depth, _local.depth = getattr(_local, "depth", 0), 0
    try:
        yield
    finally:
        _local.depth = depth


def discarding_recompute(fn: Callable) -> Callable:
    """``fn`` for one checkpoint call: its first call (the forward) runs as it is, every later
    call (the checkpoint's recompute) under :func:`output_discarded`."""
    calls = 0

    def run(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            with output_read():  # a block replayed in backward: its output feeds the next one
                return fn(*args, **kwargs)
        with output_discarded():
            return fn(*args, **kwargs)

    return run
