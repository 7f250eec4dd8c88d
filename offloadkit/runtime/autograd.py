"""Autograd helpers shared by the engine, checkpointing and layer streaming.

Every private autograd API offloadkit relies on is called here and nowhere else, so a
PyTorch upgrade that moves one has a single place to mend.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

__all__ = [
    "current_graph_task",
    "first_grad_fn",
    "in_backward",
    "in_fsdp_reduce",
    "in_function_backward",
    "pop_saved_tensor_hooks",
    "push_saved_tensor_hooks",
    "queue_engine_callback",
    "version_alias",
    "version_of",
]


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


def current_graph_task() -> int | None:
    """Id of the backward pass (graph task) running on this thread, or None outside one."""
    task = torch._C._current_graph_task_id()
    return None if task == -1 else task


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (checkpoint
    recompute included)."""
    return torch._C._current_graph_task_id() != -1


def queue_engine_callback(fn) -> bool:
    """Run ``fn`` when the current backward pass ends; False outside a backward pass."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(fn)
    except RuntimeError:
        return False
    return True


def push_saved_tensor_hooks(pack, unpack) -> None:
    """Route tensors saved on this thread through ``pack``/``unpack`` until the matching pop
    (what ``saved_tensors_hooks.__enter__`` does, without building an object per call)."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def pop_saved_tensor_hooks() -> None:
    torch._C._autograd._pop_saved_tensors_default_hooks()


def version_alias(t: torch.Tensor) -> torch.Tensor | None:
    """An empty tensor sharing ``t``'s version counter but not its memory.

    Saved-tensor hooks turn autograd's own "modified by an inplace operation" check off.
    To keep it without keeping the memory alive: a detached alias shares the version
    counter, and assigning ``.data`` swaps its storage for an empty one while keeping that
    counter (no version bump, so nothing another thread reads changes). Returns None for
    tensor subclasses, whose ``.data`` may not be plain; callers then use a weaker check.
    """
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return None
    alias = t.detach()
    alias.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter: it moves on every in-place change of ``t`` or a view of it
    (an optimizer's update included), not when ``.data`` is reassigned."""
    return t._version


# The engine runs an autograd Function's backward through this method.
_FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__


def in_function_backward() -> bool:
    """Whether this thread runs inside an autograd Function's backward: a backward started
    there (a reentrant checkpoint's segment) is nested in another one, which may still add to
    the gradients it accumulates. A nested backward runs on the thread of the Function that
    started it, so that Function's frame is on this thread's stack."""
    return _on_stack(_FUNCTION_BACKWARD)


def _on_stack(code) -> bool:
    """Whether a frame of ``code`` is on this thread's stack (the caller's callers)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


@functools.cache
def _fsdp_reduce_code():
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import foreach_reduce
    except ImportError:  # a build without distributed, or FSDP2 moved
        return None
    return getattr(inspect.unwrap(foreach_reduce), "__code__", None)


def in_fsdp_reduce() -> bool:
    """Whether this thread runs inside FSDP2's reduction of a module's gradients
    (``foreach_reduce``), which calls the sharded parameters' post-accumulate hooks with the
    reduce-scattered gradient of that module's backward."""
    code = _fsdp_reduce_code()
    return code is not None and _on_stack(code)
