"""Small autograd helpers shared by the engine, checkpointing and layer streaming."""

from __future__ import annotations

import torch

__all__ = ["first_grad_fn", "in_backward"]


def first_grad_fn(output):
    """The grad_fn of the first tensor (with one) in a module output: tensor, tuple, list, dict
    or a ``ModelOutput``."""
    if isinstance(output, torch.Tensor):
        return output.grad_fn
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for item in items:
        fn = first_grad_fn(item)
        if fn is not None:
            return fn
    return None


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (checkpoint
    recompute included)."""
    return torch._C._current_graph_task_id() != -1
