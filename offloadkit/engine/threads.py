"""Saved-tensor hooks for forwards on other threads than the one that entered the region.

Saved-tensor hooks are per thread: while a manager's region is open, module forwards on
other threads (``nn.DataParallel`` replicas, user threads, workers) get the manager's hooks
pushed for their duration through process-wide module hooks, removed once the region is
closed and no such forward still has them pushed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from offloadkit.engine.state import EngineState
from offloadkit.runtime.autograd import in_backward, pop_saved_tensor_hooks, push_saved_tensor_hooks

__all__ = ["FollowThreads"]


class FollowThreads:
    """The threads of one engine (``shared``) that entered its region, and the pushing of its
    hooks (``pack``, ``unpack``: the manager's own) on the others."""

    def __init__(self, shared: EngineState, pack: Callable, unpack: Callable) -> None:
        self.shared = shared
        self.pack, self.unpack = pack, unpack
        self.entered: set[int] = set()
        self.hooks: tuple = ()  # process-wide module hooks of a bare manager's open region
        self.depth = 0
        self.pushed_forwards = 0  # forwards on other threads that have the hooks pushed now

    def open(self) -> None:
        """This thread entered the region (called with the lock held)."""
        self.entered.add(threading.get_ident())
        if not self.depth:
            self.hooks = (
                register_module_forward_pre_hook(self._follow_pre),
                register_module_forward_hook(self._follow_post, always_call=True),
            )
        self.depth += 1

    def close(self) -> None:
        """This thread left the region (called with the lock held)."""
        if self.depth:
            self.depth -= 1
            self.release()
        self.entered.discard(threading.get_ident())

    def release(self) -> None:
        """Remove the process-wide module hooks once the region is closed and no forward on
        another thread still has the saved-tensor hooks pushed: such a forward, begun inside
        the region, needs the post-hook that pops them, or they would outlive the region on
        that thread. Called with the lock held."""
        if not self.depth and not self.pushed_forwards and self.hooks:
            for handle in self.hooks:
                handle.remove()
            self.hooks = ()

    def pre_hook(self, module, args) -> None:
        """Push the hooks for the outermost module forward of a thread that did not enter
        (see :meth:`~offloadkit.OffloadActivations.thread_pre_hook`)."""
        shared = self.shared
        state = shared.thread()
        if (
            self.entered
            and threading.get_ident() not in self.entered
            and torch.is_grad_enabled()
            and not state.pushed
            and not in_backward()
        ):
            shared.reset_forward()  # a pooled worker thread may keep the state of its last forward
            push_saved_tensor_hooks(self.pack, self.unpack)
            state.pushed.append(module)
            with shared.lock:
                self.pushed_forwards += 1

    def post_hook(self, module, args, output) -> None:
        """Pop the hooks at the end of the forward that pushed them."""
        shared = self.shared
        state = shared.thread()
        if state.pushed and state.pushed[-1] is module:
            state.pushed.pop()
            pop_saved_tensor_hooks()
            with shared.lock:
                self.pushed_forwards -= 1
                self.release()

    def _follow_pre(self, module, args) -> None:
        if not torch.compiler.is_compiling():  # compiled code runs on the thread that called it
            self.pre_hook(module, args)

    def _follow_post(self, module, args, output) -> None:
        if not torch.compiler.is_compiling():
            self.post_hook(module, args, output)
