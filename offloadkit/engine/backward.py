"""The backward half of the engine: which graph a pass consumes, what to fetch ahead, and
when resident copies go.

A pass starts at the first unpack of a step's entry under a graph task (or earlier, when
backward reaches the head or a checkpointed block). Sources still in the forward stash
become the first resident copies; the prefetch window then keeps the next entries (in the
learned or the reverse save order) on their way, so the compute stream only waits for a
copy that could not have started earlier. A resident copy is dropped once every handle
sharing it has been unpacked; the end of the pass drops what was fetched and never used.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from offloadkit.engine.prefetch import PrefetchPlanner, Step
from offloadkit.engine.spans import Entry, Kept, Packed
from offloadkit.engine.stats import OffloadStats, WaitClock
from offloadkit.runtime.autograd import current_graph_task
from offloadkit.runtime.device import current_stream
from offloadkit.transfer.completion import order_after
from offloadkit.transfer.prefetch import Ahead, Lane, PrefetchScheduler, Status
from offloadkit.transfer.timeline import StepTimeline

__all__ = ["BackwardPath"]


class BackwardPath:
    """Unpack, passes, prefetch and residency of :class:`~offloadkit.OffloadActivations`
    (which holds the state declared here)."""

    _lock: threading.RLock
    _stash: deque[Entry]
    _passes: dict[int, Step]
    _planner: PrefetchPlanner
    _clock: WaitClock
    stats: OffloadStats
    prefetch: int
    prefetch_bytes: int | None
    scheduler: PrefetchScheduler
    _lane: Lane
    timeline: StepTimeline

    def _drain(self) -> None:  # the engine processes handles autograd released
        raise NotImplementedError

    def _unpack(self, packed):
        if isinstance(packed, Kept):
            return packed.unpack()
        if not isinstance(packed, Packed):
            return packed
        with self._lock:
            self._drain()
            entry, shift = packed.entry.resolve()
            if entry.released:
                raise RuntimeError(
                    "offloadkit: a saved tensor was unpacked after its offloaded copy was freed "
                    "(was the manager closed while its graph was still alive?)"
                )
            packed.check_version()
            step = entry.step
            self._pass_for(step)
            if entry.gpu is None:
                self._fetch(entry)
                self.stats.prefetch_misses += 1
            elif entry.prefetched:
                self.stats.prefetch_hits += 1
                entry.mark_prefetched(False)
                self._lane.settle(entry.nbytes)  # used: it leaves the look-ahead window
            self._planner.on_consumed(step, entry)
            self._look_ahead(step, entry)
            consumer = current_stream(entry.device)
            self._clock.wait(consumer, entry.gpu_ready, "backward", self.stats)
            if consumer is not None and entry.gpu_stream is not None and consumer != entry.gpu_stream:
                # Freed memory returns to the stream it was allocated on; record this use too.
                entry.gpu.record_stream(consumer)
            # The resident copy is a fetched buffer (offset 0) or, for a source still on the
            # device, a view of the original storage starting at entry.start.
            offset = (entry.gpu.storage_offset() + shift) // packed.itemsize + packed.offset
            out = torch.empty(0, dtype=packed.dtype, device=entry.device).set_(
                entry.gpu.untyped_storage(), offset, packed.size, packed.stride
            )
            if packed.seen_gen != entry.gen:
                packed.seen_gen = entry.gen
                if entry.consumed_by_one():
                    # Every sharer has its view; ``out`` keeps the memory alive while in use.
                    self._drop_resident(entry, consumed=True)
            return out

    def _pass_for(self, step: Step) -> None:
        """Make sure a backward pass of the current graph task is consuming ``step``."""
        task = current_graph_task()
        if self._passes.get(step.id) is step and step.task == task:
            return
        if self._passes.get(step.id) is step:
            self._finish_pass(step)  # a pass that failed, or a new graph task on the same graph
        if step.passes == 0:
            self._window(step)
        if self._planner.begin_pass(step, task):
            self.stats.replayed_passes += 1
        self._passes[step.id] = step
        self.timeline.ensure_backward_end()  # -> _end_backward(task)
        # Sources still on the device are the newest entries: backward needs them first.
        for entry in [e for e in self._stash if e.step is step]:
            self._stash.remove(entry)
            self._make_resident(
                entry, entry.src, ready=None, stream=entry.src_stream, guard=(entry.src_stream, entry.stored.done)
            )
            entry.drop_source()
            self.stats.stash_hits += 1
        self._look_ahead(step, None)

    def _window(self, step: Step) -> None:
        if self.prefetch_bytes is None:
            step.window_bytes = sum(e.nbytes for e in step.by_seq.values()) // 16
        else:
            step.window_bytes = self.prefetch_bytes

    def _end_backward(self, task: int) -> None:
        with self._lock:
            for step in [s for s in self._passes.values() if s.task == task]:
                self._finish_pass(step)

    def _finish_pass(self, step: Step) -> None:
        self._drain()
        for entry in list(step.by_seq.values()):
            if entry.gpu is not None:
                self._drop_resident(entry, consumed=False)  # fetched but never used this pass
        self._planner.end_pass(step)
        self._passes.pop(step.id, None)
        self._clock.collect(self.stats)

    def _look_ahead(self, step: Step, current: Entry | None) -> None:
        # The look-ahead counts save groups (all inputs of one checkpointed block) or, outside
        # them, single entries: a block whose recompute needs four inputs at once (hidden
        # states, mask, rotary cos/sin) must not use up a horizon of two on its own.
        ahead = Ahead(groups=self.prefetch, min_bytes=step.window_bytes if self.prefetch > 0 else 0)
        self.scheduler.prefetch(self._lane, self._upcoming(step, current), ahead)

    def _upcoming(self, step: Step, current: Entry | None):
        for entry in self._planner.upcoming(step, current):
            yield entry, entry.nbytes, entry.group, Status.HERE if entry.gpu is not None else Status.FETCH

    def _fetch_ahead(self, entry) -> None:
        self._fetch(entry)
        entry.mark_prefetched(True)

    def _fetch(self, entry: Entry) -> None:
        loaded = entry.stored.tier.load(entry.stored)
        self.stats.restored_bytes += entry.nbytes
        self._make_resident(
            entry,
            loaded.data,
            loaded.ready,
            loaded.alloc_stream,
            guard=(loaded.alloc_stream, loaded.ready) if loaded.ready is not None else None,
        )

    def _make_resident(self, entry: Entry, data, ready, stream, guard) -> None:
        entry.make_resident(data, ready, stream, guard)

    def _drop_resident(self, entry: Entry, consumed: bool) -> None:
        if entry.prefetched:
            self._lane.settle(entry.nbytes)  # fetched ahead and never used: it leaves the window
        guard = entry.gpu_guard
        if guard is not None and guard[1] is not None:
            if not consumed or guard[1] is not entry.gpu_ready:
                # Unconsumed prefetch: the copy may still write it. Stash source: the
                # device->host copy may still read it. Either way, order the reuse after it.
                order_after(guard[0], guard[1])
        entry.drop_resident()
