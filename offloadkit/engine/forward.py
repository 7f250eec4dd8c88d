"""The forward half of the engine: what a saved tensor becomes, and the in-flight stash.

Pack: the policy (or an excluded region, or the head's tail) may keep a tensor where it is
(:class:`~offloadkit.engine.spans.Kept`, which still checks in-place writes). Otherwise its
storage byte range is found in, merged with, or added to the current step's entries, and
autograd keeps a small :class:`~offloadkit.engine.spans.Packed` handle. A new range starts
its copy through the storage tier; the device source stays in a bounded stash until the
copy has landed, and the source's stream waits on that copy before its memory is reused.

An output kept for a checkpoint's recompute (fused attention's, ``checkpointing/attention.py``)
takes the same path (:meth:`ForwardPath.save_output`), decided by its own rule: it is an entry
of the forward's step and the block's group, freed when its handle goes.
"""

from __future__ import annotations

import warnings

import torch

from offloadkit.engine.decide import REFUSED_BY_STORAGE, decide, decide_output
from offloadkit.engine.lifetime import Lifetime
from offloadkit.engine.prefetch import Step
from offloadkit.engine.spans import Entry, Kept, Packed, span_view, storage_span
from offloadkit.engine.state import EngineState
from offloadkit.runtime.autograd import in_backward
from offloadkit.runtime.device import current_stream
from offloadkit.runtime.storages import StorageRef, storage_key, version_of

__all__ = ["ForwardPath"]


class ForwardPath:
    """Pack and stash of one engine: what each save becomes, in the ``shared`` state; a
    dropped source goes through ``lifetime``."""

    def __init__(self, shared: EngineState, lifetime: Lifetime) -> None:
        self.shared = shared
        self.lifetime = lifetime
        self.budget_warned = False  # the host budget's refusal is told once

    def pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        shared = self.shared
        state = shared.thread()
        state.saves += 1
        # in_backward first: on CUDA a save inside backward runs on the engine's device
        # thread, which inherits the hooks but none of this thread's forward state.
        decision = decide(
            t,
            shared.policy,
            closed=shared.closed,
            in_backward=in_backward(),
            excluded=bool(state.keep_depth or state.tail),
            placed=state.placed,
        )
        with shared.lock:
            shared.stats.saved_tensors += 1
            handle: Packed | Kept | None = self._hold(t, decision.where, state) if decision.offload else None
            if handle is None:
                if decision.offload:
                    self._warn_budget()
                    decision = REFUSED_BY_STORAGE
                shared.stats.note_kept(decision.reason, nbytes)
                handle = Kept(t)
            return self._register(handle)

    def save_output(self, t: torch.Tensor) -> Packed | Kept | None:
        """Hold ``t``, an output a checkpoint's recompute takes instead of computing it again
        (``decide_output``): offloaded like a saved tensor, with the saves of its thread's
        forward and block (its step and group, so backward fetches it with the block's input),
        a :class:`Kept` where it is small, or None where it is not kept (the kernel runs
        again). Not a save of autograd's: not numbered for the ``tracker`` view."""
        shared = self.shared
        state = shared.thread()
        state.saves += 1
        decision = decide_output(t, shared.policy, closed=shared.closed, placed=state.placed)
        with shared.lock:
            shared.stats.recompute_outputs += 1
            if decision.reason == "small":
                shared.stats.note_kept(decision.reason, t.numel() * t.element_size())
                return Kept(t)
            return self._hold(t, decision.where, state, for_recompute=True) if decision.offload else None

    def _hold(self, t: torch.Tensor, where: str | None, state, for_recompute: bool = False) -> Packed | None:
        """A handle on an entry holding ``t``'s bytes (found, merged or new), or None where the
        storage tier refused them (caller holds the lock). ``for_recompute``: ``t`` is an
        output kept for a recompute; its entry is marked so where it holds nothing else."""
        shared = self.shared
        nbytes = t.numel() * t.element_size()
        self.lifetime.drain()
        step = state.step
        if step is None or step.passes or step.live <= 0:
            step = state.step = Step()  # a new forward, or one whose backward already began
        storage = t.untyped_storage()
        start, end = storage_span(t)
        key, version, now = storage_key(storage), version_of(t), state.saves
        entry = self._find(step, key, start, end, version, now)
        copied = entry is None
        if entry is not None:
            entry.saved_again(state.group, for_recompute)  # needed with its newest saver's group
            shared.stats.deduplicated_tensors += 1
            shared.stats.deduplicated_bytes += nbytes
            shared.planner.on_saved(step, entry, new=False)  # backward needs it at its newest use
        else:
            overlapping = self._overlapping(step, key, start, end, version, now)
            lo, hi = start, end
            whole = storage.nbytes()
            if 2 * (end - start) >= whole and not any(e.step is step for e in shared.by_storage.get(key, ())):
                # Most of a fresh storage is needed: move all of it, so that its other parts
                # saved right after (the halves of a fused projection, a tensor saved after
                # its slice) are served by this copy instead of being copied again.
                lo, hi = 0, whole
            for e in overlapping:
                lo, hi = min(lo, e.start), max(hi, e.end)
            entry = self._offload(step, storage, lo, hi, t.device, version, where)
            if entry is None and (lo, hi) != (start, end) and not overlapping:
                # The view alone may fit.
                entry = self._offload(step, storage, start, end, t.device, version, where)
            if entry is None:
                return None
            entry.first_saved(
                state.group,
                now,
                (
                    min(start, *(e.span_start for e in overlapping)) if overlapping else start,
                    max(end, *(e.span_end for e in overlapping)) if overlapping else end,
                ),
            )
            for old in overlapping:
                self._merge(old, entry)
            entry.mark_for_recompute(for_recompute and all(old.for_recompute for old in overlapping))
        entry.add_handle()
        return Packed(entry, t, shared.dead, copied)

    def _register(self, handle):
        """Number the save and remember it weakly: read by the ``tracker`` view (caller holds the lock)."""
        shared = self.shared
        shared.tensor_id += 1
        shared.saves[shared.tensor_id] = handle
        return handle

    def tracker(self) -> dict[int, tuple]:
        """The saves autograd still holds, by id (the manager's ``tracker``)."""
        shared = self.shared
        with shared.lock:
            saves = list(shared.saves.items())
        out = {}
        for tid, handle in saves:
            if isinstance(handle, Kept):
                t = handle.tensor
                out[tid] = (t, False, t.stride(), t.storage_offset(), t.shape)
            else:
                offset = (handle.entry.start // handle.itemsize) + handle.offset
                out[tid] = (None, handle.copied, handle.stride, offset, handle.size)
        return out

    def storage_to_tensor_id(self) -> dict[int, int]:
        """The save that copied each storage range still held (the manager's ``storage_to_tensor_id``)."""
        with self.shared.lock:
            saves = list(self.shared.saves.items())
        return {id(h.entry): tid for tid, h in saves if not isinstance(h, Kept) and h.copied}

    def _find(self, step: Step, key: int, start: int, end: int, version: int, now: int) -> Entry | None:
        shared = self.shared
        # Same storage and graph, range covered, and no in-place write since the copy was taken
        # (views share their base's version counter).
        for entry in shared.by_storage.get(key, ()):
            if entry.step is step and entry.version == version:
                lo, hi = _reach(entry, now)
                if lo <= start and end <= hi:
                    return entry
        return None

    def _overlapping(self, step: Step, key: int, start: int, end: int, version: int, now: int) -> list[Entry]:
        shared = self.shared
        out = []
        for e in shared.by_storage.get(key, ()):
            if e.step is step and e.version == version:
                lo, hi = _reach(e, now)
                if lo < end and start < hi:
                    out.append(e)
        return out

    def _merge(self, old: Entry, new: Entry) -> None:
        """``new`` covers ``old``'s range: serve ``old``'s handles from it and give ``old``'s
        copy back, so each storage's bytes are held once (a slice saved before the whole)."""
        shared = self.shared
        old.merge_into(new)
        shared.stats.offloaded_bytes -= old.nbytes
        shared.stats.offloaded_tensors -= 1
        shared.stats.merged_entries += 1
        if old.src is not None:
            try:
                shared.stash.remove(old)
            except ValueError:
                pass
            # Copies on one stream run in order: new's copy, queued after, covers old's source.
            same = new.stored.done_stream is not None and old.stored.done_stream is new.stored.done_stream
            self.lifetime.drop_source(old, wait=not same)
        shared.entries.discard(old)
        shared.by_storage[old.key].remove(old)
        shared.planner.on_released(old)
        old.stored.tier.free(old.stored)  # its pending copy is remembered by the tier

    def _offload(
        self, step: Step, storage, start: int, end: int, device: torch.device, version: int, where: str | None
    ):
        shared = self.shared
        src = span_view(storage, start, end, device)
        # A planned place only when there is one: tiers written before places need not take it.
        stored = shared.tier.store(src) if where is None else shared.tier.store(src, where)
        if stored is None:
            return None
        entry = Entry(
            key=storage_key(storage),
            weak=_weak(storage),
            start=start,
            end=end,
            device=device,
            stored=stored,
            version=version,
        )
        shared.stats.offloaded_tensors += 1
        shared.stats.offloaded_bytes += entry.nbytes
        shared.stats.copied_bytes += entry.nbytes
        shared.entries.add(entry)
        shared.by_storage.setdefault(entry.key, []).append(entry)
        shared.planner.on_saved(step, entry, new=True)
        if not stored.copy_finished():
            entry.keep_source(src, current_stream(device))
            shared.stash.append(entry)
            self._trim_stash()
        return entry

    def _warn_budget(self) -> None:
        if not self.budget_warned:
            self.budget_warned = True
            warnings.warn(
                f"offloadkit: host-memory budget reached ({self.shared.budget.describe()}); further "
                "activations stay on the device. Raise host_budget_bytes or add a disk tier.",
                RuntimeWarning,
                stacklevel=6,  # under the manager's pack hook
            )

    def _trim_stash(self) -> None:
        shared = self.shared
        stash = shared.stash
        # Copies complete in order on the side stream: drop landed sources from the front.
        while stash and stash[0].stored.copy_finished():
            self.lifetime.drop_source(stash.popleft(), wait=False)
        while len(stash) > shared.max_fwd_stash_size:
            self.lifetime.drop_source(stash.popleft(), wait=True)

    def flush_stash(self) -> None:
        """Let go of every source in the stash; reusing its memory waits for its copy."""
        shared = self.shared
        while shared.stash:
            self.lifetime.drop_source(shared.stash.popleft(), wait=True)


# Saves within this many of a copy that moved a whole storage may be served by its extra
# bytes; later ones only by the bytes their own saver needed. One resident copy then never
# spans far in backward, and bytes written without a version bump (``.data``, custom kernels)
# are not handed to a save made long after the copy.
NEAR_SAVES = 4


def _reach(entry: Entry, now: int) -> tuple[int, int]:
    """The byte range ``entry`` may serve a save made at ``now``."""
    if now - entry.born <= NEAR_SAVES:
        return entry.start, entry.end
    return entry.span_start, entry.span_end


def _weak(storage):
    return StorageRef(storage)
