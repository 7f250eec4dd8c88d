"""The points of a training step that feed the prefetch scheduler, hooked once per model.

Every client that moves bytes ahead of need (saved activations, streamed weights) acts at the
same few points of a step: the forward starts, a block starts and ends, the output head runs,
backward reaches the head or a block's output, backward ends. :class:`StepTimeline` owns the
hooks for those points; clients subscribe a :class:`TimelineListener` and never hook the model
themselves. A run with several clients (``prepare()``) shares one timeline, so one grad_fn
pre-hook per point and one end-of-backward callback per backward serve them all, in the order
they subscribed.

Backward points are armed in forward: a listener's ``head_end``/``block_end`` returns what to
run when backward reaches that output (or None), so it can bind forward-time state (the step a
forward saved into) to the backward event.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Iterable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from offloadkit.runtime.autograd import current_graph_task, first_grad_fn, queue_engine_callback

__all__ = ["StepTimeline", "TimelineListener"]

BackwardCall = Callable[[], None]


class TimelineListener:
    """What a client does at each point of a step; every method is optional (no-op here).

    Forward points also run for module forwards inside backward (a checkpoint's recompute); a
    listener that must tell them apart asks ``runtime.autograd.in_backward()``.
    """

    def forward_start(self, module: nn.Module, args: tuple) -> None:
        """The model's forward begins."""

    def forward_end(self, module: nn.Module, output) -> None:
        """The model's forward returned or raised (``output`` is None then)."""

    def block_start(self, block: nn.Module) -> None:
        """A watched block's forward begins."""

    def block_end(self, block: nn.Module, output) -> BackwardCall | None:
        """A watched block's forward returned or raised; returns what to run when backward
        reaches this output."""
        return None

    def head_start(self) -> None:
        """The output head's forward begins."""

    def head_end(self, output) -> BackwardCall | None:
        """The output head's forward returned; returns what to run when backward starts there."""
        return None

    def backward_end(self, task: int) -> None:
        """The backward pass (graph task ``task``) that reached a point of this timeline ended."""


def _eager(hook):
    """A hook that runs eagerly inside a compiled model: listeners keep Python state that a
    graph cannot hold, and guards on it would recompile every step."""
    return torch.compiler.disable(hook)


class StepTimeline:
    """One set of step hooks on ``model`` (forward start/end, the head), on the blocks given to
    :meth:`watch_blocks`, and one end-of-backward callback per backward pass.

    Args:
        model: the root module whose forward is a step; None for a timeline of blocks and
            backward ends only (an engine used as a bare context manager).
        head: the output head, or None when the model has none (backward then starts at the
            last block's output).

    Example:
        >>> timeline = StepTimeline(model, head=model.lm_head)  # doctest: +SKIP
        >>> handle = timeline.subscribe(listener)  # doctest: +SKIP
        >>> timeline.remove()  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module | None = None, *, head: nn.Module | None = None) -> None:
        self._listeners: OrderedDict[int, TimelineListener] = OrderedDict()
        self._handles: list = []
        self._blocks: dict[int, list] = {}  # id(block) -> [pre hook, post hook, watchers]
        self._lock = threading.Lock()
        # Graph tasks whose end callback is queued; one that raised stays (ids are never reused).
        self._queued: set[int] = set()
        self.model: nn.Module | None = None
        self.head: nn.Module | None = None
        self.attach(model, head)

    def attach(self, model: nn.Module | None, head: nn.Module | None = None) -> None:
        """Hook ``model``'s forward and ``head`` where this timeline has none yet (a client
        that knows the model joining a timeline made without one).

        Raises:
            ValueError: the timeline is on another model, or has another head.
        """
        if model is not None and self.model is not None and model is not self.model:
            raise ValueError(
                f"this StepTimeline is on another model ({type(self.model).__name__}); give each model its own"
            )
        self.check_head(head if self.head is not None else None, "a client of this StepTimeline")
        if model is not None and self.model is None:
            self.model = model
            self._handles.append(model.register_forward_pre_hook(_eager(self._forward_start)))
            self._handles.append(model.register_forward_hook(_eager(self._forward_end), always_call=True))
        if head is not None and self.head is None:
            self.head = head
            self._handles.append(head.register_forward_pre_hook(_eager(self._head_start)))
            self._handles.append(head.register_forward_hook(_eager(self._head_end)))

    # -- subscribing ---------------------------------------------------------------------------
    def subscribe(self, listener: TimelineListener) -> RemovableHandle:
        """Call ``listener`` at every point from now on, after the listeners subscribed before.

        Returns:
            A handle whose ``remove()`` unsubscribes it.
        """
        if not isinstance(listener, TimelineListener):
            raise ValueError(f"listener={listener!r} is invalid; subclass transfer.TimelineListener")
        handle = RemovableHandle(self._listeners)
        self._listeners[handle.id] = listener
        return handle

    def watch_blocks(self, blocks: Iterable[nn.Module]) -> _BlockHooks:
        """Report ``blocks``' forwards and arm backward at their outputs. A block is hooked
        once however many clients watch it; its hooks go when the last of them stops.

        Returns:
            A handle whose ``remove()`` stops this call's watching.
        """
        added = _BlockHooks(self)
        for block in blocks:
            key = id(block)
            if key not in self._blocks:
                self._blocks[key] = [
                    block.register_forward_pre_hook(_eager(self._block_start)),
                    block.register_forward_hook(_eager(self._block_end), always_call=True),
                    0,
                ]
            self._blocks[key][2] += 1
            added.blocks.append(key)
        return added

    def _unwatch(self, keys: list[int]) -> None:
        for key in keys:
            entry = self._blocks.get(key)
            if entry is None:
                continue
            entry[2] -= 1
            if entry[2] == 0:
                entry[0].remove()
                entry[1].remove()
                del self._blocks[key]

    def check_head(self, head: nn.Module | None, who: str) -> None:
        """Refuse a client whose head differs from this timeline's (``ValueError`` naming ``who``)."""
        if head is not None and head is not self.head:
            raise ValueError(
                f"{who}: head={type(head).__name__} is not the shared timeline's head "
                f"({type(self.head).__name__ if self.head is not None else None}); build the StepTimeline with "
                "head=<that module> and pass no head here"
            )

    def remove(self) -> None:
        """Detach every module hook and let go of the model. Listeners stay subscribed: a
        client still running backward passes (an engine used as a bare context manager) keeps
        its ends of backward."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for pre, post, _ in self._blocks.values():
            pre.remove()
            post.remove()
        self._blocks.clear()
        self.model = self.head = None  # a closed run does not keep the model alive

    # -- the end of backward ------------------------------------------------------------------
    def ensure_backward_end(self) -> None:
        """Have every listener's ``backward_end`` run when the backward pass running now ends
        (once per pass; nothing outside one). Keyed by graph task, not a flag: a backward that
        raised never runs its callback, and the next pass must still queue its own."""
        task = current_graph_task()
        if task is None:
            return
        with self._lock:
            if task in self._queued:
                return
            if queue_engine_callback(lambda: self._backward_end(task)):
                self._queued.add(task)

    def _backward_end(self, task: int) -> None:
        with self._lock:
            self._queued.discard(task)
        for listener in tuple(self._listeners.values()):
            listener.backward_end(task)

    def _arm(self, output, calls: list[BackwardCall]) -> None:
        """Run ``calls`` when backward reaches ``output`` (before any of its producer's work,
        a checkpoint's recompute included)."""
        calls = [c for c in calls if c is not None]
        grad_fn = first_grad_fn(output) if calls else None
        if grad_fn is None:
            return

        def reached(grad_outputs):
            self.ensure_backward_end()
            for call in calls:
                call()

        grad_fn.register_prehook(reached)

    # -- hooks --------------------------------------------------------------------------------
    def _forward_start(self, module, args) -> None:
        for listener in tuple(self._listeners.values()):
            listener.forward_start(module, args)

    def _forward_end(self, module, args, output) -> None:
        for listener in tuple(self._listeners.values()):
            listener.forward_end(module, output)

    def _head_start(self, module, args) -> None:
        for listener in tuple(self._listeners.values()):
            listener.head_start()

    def _head_end(self, module, args, output) -> None:
        self._arm(output, [listener.head_end(output) for listener in tuple(self._listeners.values())])

    def _block_start(self, block, args) -> None:
        for listener in tuple(self._listeners.values()):
            listener.block_start(block)

    def _block_end(self, block, args, output) -> None:
        self._arm(output, [listener.block_end(block, output) for listener in tuple(self._listeners.values())])


class _BlockHooks:
    """The watching of blocks one :meth:`StepTimeline.watch_blocks` call asked for."""

    def __init__(self, timeline: StepTimeline) -> None:
        self.timeline: StepTimeline | None = timeline
        self.blocks: list[int] = []

    def remove(self) -> None:
        timeline, self.timeline = self.timeline, None
        if timeline is None:
            return
        timeline._unwatch(self.blocks)
        self.blocks.clear()
