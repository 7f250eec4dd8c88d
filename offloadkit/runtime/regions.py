"""A checkpoint region that spans several module calls (PyTorch's private non-reentrant
checkpoint generator, used here only).

``torch.utils.checkpoint.checkpoint`` wraps one function call. A region is entered before one
block runs and left after a later block has run, so everything autograd saves in between is
dropped and recomputed in backward by one replay function, called with the region's inputs.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch.utils.checkpoint as _checkpoint

__all__ = ["checkpoint_region"]

_GENERATOR = getattr(_checkpoint, "_checkpoint_without_reentrant_generator", None)
# Leading parameters before ``*args``: (fn, preserve_rng_state, context_fn, determinism_check,
# debug[, early_stop]); ``early_stop`` is absent from some releases.
_HAS_EARLY_STOP = _GENERATOR is not None and "early_stop" in inspect.signature(_GENERATOR).parameters


def checkpoint_region(replay: Callable, *args, **kwargs):
    """A context manager: what autograd saves inside it is dropped, and recomputed in backward
    by ``replay(*args, **kwargs)`` (which must run the same operations in the same order).

    Args:
        replay: recomputes the region from its inputs.
        *args, **kwargs: the region's inputs; tensors among ``args`` are saved as a checkpoint's
            inputs are (through any saved-tensor hooks active when the region is entered).

    Raises:
        RuntimeError: this PyTorch has no non-reentrant checkpoint generator.
    """
    if _GENERATOR is None:
        raise RuntimeError("this PyTorch build has no non-reentrant checkpoint generator; upgrade PyTorch")
    leading: tuple = (replay, True, _checkpoint.noop_context_fn, "default", False)
    if _HAS_EARLY_STOP:
        leading = (*leading, True)
    made = _GENERATOR(*leading, *args, **kwargs)
    return made if hasattr(made, "__enter__") else _Region(made)


class _Region:
    """The bare generator (as recent releases return it) driven as a context manager."""

    def __init__(self, generator) -> None:
        self._generator = generator

    def __enter__(self):
        next(self._generator)  # saves the inputs and installs the region's saved-tensor hooks
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            next(self._generator, None)  # removes the hooks, marks the forward complete
        else:
            self._generator.close()
