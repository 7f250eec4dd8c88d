"""How a block is called, seen by checkpointing: its hidden state in what it returns, the
cache arguments a checkpointed block must not get, and keyword tensors moved to positions (a
checkpoint saves positional tensors through the saved-tensor hooks, keyword ones as plain
Python objects)."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["CACHE_KEYS", "first_tensor", "is_cache", "keywords_as_positions"]


def first_tensor(out):
    """A block's hidden state: its output, or the output's first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    for item in out if isinstance(out, (tuple, list)) else ():
        if isinstance(item, torch.Tensor):
            return item
    raise TypeError(f"a block returned {type(out).__name__} without a tensor; recompute_inputs cannot chain it")


# Names a decoder layer's cache argument has had across transformers releases.
CACHE_KEYS = frozenset({"past_key_values", "past_key_value", "layer_past", "cache"})


def is_cache(value) -> bool:
    """A transformers cache object, whatever the argument is called (read by type, so a
    renamed keyword in a later release is still caught)."""
    return any(cls.__module__.startswith("transformers.cache_utils") for cls in type(value).__mro__)


def _tensor_leaves(value, out: list) -> object:
    """``value`` with each tensor replaced by its index in ``out`` (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        out.append(value)
        return _Slot(len(out) - 1)
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_tensor_leaves(v, out) for v in value)
    if type(value) is dict:
        return {k: _tensor_leaves(v, out) for k, v in value.items()}
    return value


def _rebuild(value, tensors):
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_rebuild(v, tensors) for v in value)
    if type(value) is dict:
        return {k: _rebuild(v, tensors) for k, v in value.items()}
    return value


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def keywords_as_positions(original: Callable, args: tuple, kwargs: dict):
    """A function taking ``(*args, *keyword_tensors)`` that calls ``original`` as before."""
    tensors: list = []
    structure = {k: _tensor_leaves(v, tensors) for k, v in kwargs.items()}
    if not tensors:
        return original, args, kwargs
    n = len(args)

    def call(*flat):
        return original(*flat[:n], **_rebuild(structure, flat[n:]))

    return call, (*args, *tensors), {}
