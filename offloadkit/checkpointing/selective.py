"""Selective activation checkpointing: save the outputs of chosen ops, recompute the rest.

Built on PyTorch's selective checkpoint contexts: the returned ``context_fn`` is passed
to non-reentrant ``torch.utils.checkpoint.checkpoint``.
"""

from __future__ import annotations

from functools import partial
from typing import Iterable

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from offloadkit.runtime.ops import OpOverload, OpOverloadPacket

__all__ = ["OP_GROUPS", "resolve_ops", "selective_context_fn"]


def _ops(*names: str) -> list:
    aten = torch.ops.aten
    return [getattr(aten, n).default for n in names if hasattr(aten, n)]


# Named groups users can ask for; ops are matched after dispatch (linear -> mm/addmm).
OP_GROUPS: dict[str, list] = {
    "mm": _ops("mm", "addmm", "bmm", "baddbmm"),
    "attention": _ops(
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    ),
}


def resolve_ops(save: Iterable) -> frozenset:
    """Group names ("mm", "attention") and/or aten op overloads -> a set of overloads."""
    ops = set()
    for item in save:
        if isinstance(item, str):
            if item not in OP_GROUPS:
                raise ValueError(f"selective op group {item!r} is unknown; use one of {sorted(OP_GROUPS)} or aten ops")
            ops.update(OP_GROUPS[item])
        elif isinstance(item, OpOverloadPacket):
            ops.update(getattr(item, o) for o in item.overloads())
        elif isinstance(item, OpOverload):
            ops.add(item)
        else:
            raise ValueError(f"selective save entry {item!r} is neither a group name nor an aten op")
    if not ops:
        raise ValueError("selective checkpointing needs at least one op to save")
    return frozenset(ops)


def _policy(save_ops: frozenset, ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn(save: Iterable = ("mm", "attention")):
    """A ``context_fn`` that saves the outputs of ``save`` ops and recomputes everything else.

    Example:
        >>> checkpoint(block, x, use_reentrant=False, context_fn=selective_context_fn(["attention"]))
    """
    policy = partial(_policy, resolve_ops(save))
    return partial(create_selective_checkpoint_contexts, policy)
