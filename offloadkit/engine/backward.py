"""The backward half of the engine: which graph a pass consumes, what to fetch ahead, and
when resident copies go.

A pass starts at the first unpack of a step's entry under a graph task (or earlier, when
backward reaches the head or a checkpointed block). Sources still in the forward stash
become the first resident copies; the prefetch window then keeps the next entries (in the
learned or the reverse save order) on their way, so the compute stream only waits for a
copy that could not have started earlier. A resident copy is dropped once every handle
sharing it has been unpacked; the end of the pass drops what was fetched and never used.
Outputs kept for a checkpoint's recompute (:meth:`BackwardPath.restore_output`) are entries
of the same step and come back through the same scheduler, as their block's backward begins
(its input unpacked) rather than with the blocks fetched ahead, and queued before the copies
of those.
"""

from __future__ import annotations

import torch

from offloadkit.engine.lifetime import Lifetime
from offloadkit.engine.prefetch import Step
from offloadkit.engine.spans import Entry, Kept, Packed
from offloadkit.engine.state import EngineState
from offloadkit.runtime.autograd import current_graph_task
from offloadkit.runtime.device import current_stream
from offloadkit.transfer.prefetch import Ahead, Status

__all__ = ["BackwardPath"]


class BackwardPath:
    """Unpack, passes, prefetch and residency of one engine, in the ``shared`` state; a
    resident copy goes through ``lifetime``."""

    def __init__(self, shared: EngineState, lifetime: Lifetime) -> None:
        self.shared = shared
        self.lifetime = lifetime

    def unpack(self, packed):
        if isinstance(packed, Kept):
            return packed.unpack()
        if not isinstance(packed, Packed):
            return packed
        shared = self.shared
        with shared.lock:
            self.lifetime.drain()
            entry, shift = packed.entry.resolve()
            if entry.released:
                raise RuntimeError(
                    "offloadkit: a saved tensor was unpacked after its offloaded copy was freed "
                    "(was the manager closed while its graph was still alive?)"
                )
            packed.check_version()
            step = entry.step
            self.pass_for(step)
            if entry.gpu is None:
                self._fetch(entry)
                shared.stats.prefetch_misses += 1
            elif entry.prefetched:
                shared.stats.prefetch_hits += 1
                entry.mark_prefetched(False)
                shared.lane.settle(entry.nbytes)  # used: it leaves the look-ahead window
            shared.planner.on_consumed(step, entry)
            if step.outputs and entry.group is not None and not entry.for_recompute:
                self._queue_kept_outputs(step, entry.group)
            self.look_ahead(step, entry)
            consumer = current_stream(entry.device)
            shared.clock.wait(consumer, entry.gpu_ready, "backward", shared.stats)
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
                    self.lifetime.drop_resident(entry, consumed=True)
            return out

    def restore_output(self, handle: Packed | Kept) -> torch.Tensor | None:
        """The device tensor of an output kept for a recompute (``ForwardPath.save_output``),
        unpacked as a saved tensor is (its pass, the look-ahead, the waits), or None where it
        was written in place since its kernel made it: the stored bytes may then not be the
        kernel's, and the recompute runs the kernel again."""
        if handle.written_since():
            return None
        if isinstance(handle, Kept):
            # Its own tensor: autograd gives the kernel's outputs a history of their own.
            return handle.tensor.clone()
        return self.unpack(handle)

    def pass_for(self, step: Step) -> None:
        """Make sure a backward pass of the current graph task is consuming ``step``."""
        shared = self.shared
        task = current_graph_task()
        if shared.passes.get(step.id) is step and step.task == task:
            return
        if shared.passes.get(step.id) is step:
            self._finish_pass(step)  # a pass that failed, or a new graph task on the same graph
        if step.passes == 0:
            self._window(step)
        if shared.planner.begin_pass(step, task):
            shared.stats.replayed_passes += 1
        shared.passes[step.id] = step
        shared.timeline.ensure_backward_end()  # -> end_backward(task)
        # Sources still on the device are the newest entries: backward needs them first.
        for entry in [e for e in shared.stash if e.step is step]:
            shared.stash.remove(entry)
            self._make_resident(
                entry, entry.src, ready=None, stream=entry.src_stream, guard=(entry.src_stream, entry.stored.done)
            )
            entry.drop_source()
            shared.stats.stash_hits += 1
        self.look_ahead(step, None)

    def _window(self, step: Step) -> None:
        shared = self.shared
        if shared.prefetch_bytes is None:
            # Of what the look-ahead brings back: kept outputs come back with their block's
            # recompute (fetch_outputs), and counted here they would double a checkpointed
            # step's window (two more block inputs held ahead at 16K on an 8B model).
            step.window_bytes = sum(e.nbytes for e in step.by_seq.values() if not e.for_recompute) // 16
        else:
            step.window_bytes = shared.prefetch_bytes

    def end_backward(self, task: int) -> None:
        shared = self.shared
        with shared.lock:
            for step in [s for s in shared.passes.values() if s.task == task]:
                self._finish_pass(step)

    def _finish_pass(self, step: Step) -> None:
        shared = self.shared
        self.lifetime.drain()
        for entry in list(step.by_seq.values()):
            if entry.gpu is not None:
                self.lifetime.drop_resident(entry, consumed=False)  # fetched but never used this pass
        shared.planner.end_pass(step)
        shared.passes.pop(step.id, None)
        shared.clock.collect(shared.stats)

    def look_ahead(self, step: Step, current: Entry | None) -> None:
        shared = self.shared
        # The look-ahead counts save groups (all inputs of one checkpointed block) or, outside
        # them, single entries: a block whose recompute needs four inputs at once (hidden
        # states, mask, rotary cos/sin) must not use up a horizon of two on its own.
        ahead = Ahead(groups=shared.prefetch, min_bytes=step.window_bytes if shared.prefetch > 0 else 0)
        shared.scheduler.prefetch(shared.lane, self._upcoming(step, current), ahead)

    def _upcoming(self, step: Step, current: Entry | None):
        shared = self.shared
        for entry in shared.planner.upcoming(step, current):
            if entry.for_recompute and entry.gpu is None:
                # Kept outputs come back when their block's recompute begins (fetch_outputs):
                # with the look-ahead, every block fetched ahead, and the head's backward,
                # would hold them beside the inputs (8 KiB a token for an 8B layer; +2 GiB at
                # the peak of a 256K step), where the recompute holds one block's.
                yield entry, entry.nbytes, entry.group, Status.SKIP
                continue
            yield entry, entry.nbytes, entry.group, Status.HERE if entry.gpu is not None else Status.FETCH

    def _queue_kept_outputs(self, step: Step, group: int) -> None:
        """Queue the copies back of the outputs ``group``'s recompute will take, now that its
        input is unpacked (the recompute begins) and before the look-ahead queues blocks
        further on: on one copy stream they would otherwise wait behind those, and the
        recompute reaches its attention within milliseconds. The same bytes, at the same
        moment, as :meth:`fetch_outputs` would bring (caller holds the lock)."""
        by_seq = step.by_seq
        kept = [by_seq[seq] for seq in sorted(step.outputs) if seq in by_seq]  # in the order kept
        self._bring_now([e for e in kept if e.group == group and e.gpu is None and not e.released])

    def _bring_now(self, entries: list[Entry]) -> None:
        """Queue every one of ``entries`` not yet on the device, whatever the look-ahead's
        horizon: a recompute needs them next (caller holds the lock)."""
        if entries:
            items = [(e, e.nbytes, None, Status.HERE if e.gpu is not None else Status.FETCH) for e in entries]
            self.shared.scheduler.prefetch(self.shared.lane, items, Ahead(min_bytes=sum(e.nbytes for e in entries)))

    def fetch_outputs(self, handles) -> None:
        """Queue the copies back of a block's kept outputs as its recompute begins, ahead of
        its attention, through the scheduler (its window counts them)."""
        shared = self.shared
        with shared.lock:  # entries merge and go under it
            entries = {id(e): e for e in (h.entry.resolve()[0] for h in handles if isinstance(h, Packed))}
            live = [e for e in entries.values() if not e.released]
            if not live:
                return
            for step in {id(e.step): e.step for e in live}.values():
                self.pass_for(step)
            self._bring_now(live)

    def fetch_ahead(self, entry) -> None:
        self._fetch(entry)
        entry.mark_prefetched(True)

    def _fetch(self, entry: Entry) -> None:
        shared = self.shared
        loaded = entry.stored.tier.load(entry.stored)
        shared.stats.restored_bytes += entry.nbytes
        self._make_resident(
            entry,
            loaded.data,
            loaded.ready,
            loaded.alloc_stream,
            guard=(loaded.alloc_stream, loaded.ready) if loaded.ready is not None else None,
        )

    def _make_resident(self, entry: Entry, data, ready, stream, guard) -> None:
        entry.make_resident(data, ready, stream, guard)
