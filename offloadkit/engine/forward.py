"""The forward half of the engine: what a saved tensor becomes, and the in-flight stash.

Pack: the policy (or an excluded region, or the head's tail) may keep a tensor where it is
(:class:`~offloadkit.engine.spans.Kept`, which still checks in-place writes). Otherwise its
storage byte range is found in, merged with, or added to the current step's entries, and
autograd keeps a small :class:`~offloadkit.engine.spans.Packed` handle. A new range starts
its copy through the storage tier; the device source stays in a bounded stash until the
copy has landed, and the source's stream waits on that copy before its memory is reused.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import deque

import torch

from offloadkit.engine.decide import REFUSED_BY_STORAGE, decide
from offloadkit.engine.policy import OffloadPolicy
from offloadkit.engine.prefetch import PrefetchPlanner, Step
from offloadkit.engine.spans import DeathQueue, Entry, Kept, Packed, span_view, storage_span
from offloadkit.engine.stats import OffloadStats, WaitClock
from offloadkit.runtime.autograd import in_backward
from offloadkit.runtime.device import current_stream
from offloadkit.runtime.storages import StorageRef, storage_key, version_of
from offloadkit.storage.base import StorageTier
from offloadkit.storage.budget import HostMemoryBudget

__all__ = ["ForwardPath"]


class ForwardPath:
    """Pack and stash of :class:`~offloadkit.OffloadActivations` (which holds the state
    declared here)."""

    _lock: threading.RLock
    _stash: deque[Entry]
    _entries: set[Entry]
    _by_storage: dict[int, list[Entry]]
    _planner: PrefetchPlanner
    _clock: WaitClock
    _dead: DeathQueue
    _budget_warned: bool
    _closed: bool
    policy: OffloadPolicy
    stats: OffloadStats
    tier: StorageTier
    budget: HostMemoryBudget
    max_fwd_stash_size: int
    tensor_id: int
    _saves: weakref.WeakValueDictionary

    def _state(self):  # per-thread forward state, kept by the engine
        raise NotImplementedError

    def _drain(self) -> None:
        raise NotImplementedError

    def _pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        state = self._state()
        state.saves += 1
        # in_backward first: on CUDA a save inside backward runs on the engine's device
        # thread, which inherits the hooks but none of this thread's forward state.
        decision = decide(
            t,
            self.policy,
            closed=self._closed,
            in_backward=in_backward(),
            excluded=bool(state.keep_depth or state.tail),
            placed=state.placed,
        )
        if not decision.offload:
            with self._lock:
                self.stats.saved_tensors += 1
                self.stats.note_kept(decision.reason, nbytes)
                return self._register(Kept(t))
        with self._lock:
            self.stats.saved_tensors += 1
            self._drain()
            step = state.step
            if step is None or step.passes or step.live <= 0:
                step = state.step = Step()  # a new forward, or one whose backward already began
            storage = t.untyped_storage()
            start, end = storage_span(t)
            key, version, now = storage_key(storage), version_of(t), state.saves
            entry = self._find(step, key, start, end, version, now)
            copied = entry is None
            if entry is not None:
                entry.saved_again(state.group)  # needed with its newest saver's group
                self.stats.deduplicated_tensors += 1
                self.stats.deduplicated_bytes += nbytes
                self._planner.on_saved(step, entry, new=False)  # backward needs it at its newest use
            else:
                overlapping = self._overlapping(step, key, start, end, version, now)
                lo, hi = start, end
                whole = storage.nbytes()
                if 2 * (end - start) >= whole and not any(e.step is step for e in self._by_storage.get(key, ())):
                    # Most of a fresh storage is needed: move all of it, so that its other parts
                    # saved right after (the halves of a fused projection, a tensor saved after
                    # its slice) are served by this copy instead of being copied again.
                    lo, hi = 0, whole
                for e in overlapping:
                    lo, hi = min(lo, e.start), max(hi, e.end)
                entry = self._offload(step, storage, lo, hi, t.device, version, decision.where)
                if entry is None and (lo, hi) != (start, end) and not overlapping:
                    # The view alone may fit.
                    entry = self._offload(step, storage, start, end, t.device, version, decision.where)
                if entry is None:
                    self._warn_budget()
                    self.stats.note_kept(REFUSED_BY_STORAGE.reason, nbytes)
                    return self._register(Kept(t))
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
            entry.add_handle()
            return self._register(Packed(entry, t, self._dead, copied))

    def _register(self, handle):
        """Number the save and remember it weakly: read by the ``tracker`` view (caller holds the lock)."""
        self.tensor_id += 1
        self._saves[self.tensor_id] = handle
        return handle

    def _find(self, step: Step, key: int, start: int, end: int, version: int, now: int) -> Entry | None:
        # Same storage and graph, range covered, and no in-place write since the copy was taken
        # (views share their base's version counter).
        for entry in self._by_storage.get(key, ()):
            if entry.step is step and entry.version == version:
                lo, hi = _reach(entry, now)
                if lo <= start and end <= hi:
                    return entry
        return None

    def _overlapping(self, step: Step, key: int, start: int, end: int, version: int, now: int) -> list[Entry]:
        out = []
        for e in self._by_storage.get(key, ()):
            if e.step is step and e.version == version:
                lo, hi = _reach(e, now)
                if lo < end and start < hi:
                    out.append(e)
        return out

    def _merge(self, old: Entry, new: Entry) -> None:
        """``new`` covers ``old``'s range: serve ``old``'s handles from it and give ``old``'s
        copy back, so each storage's bytes are held once (a slice saved before the whole)."""
        old.merge_into(new)
        self.stats.offloaded_bytes -= old.nbytes
        self.stats.offloaded_tensors -= 1
        self.stats.merged_entries += 1
        if old.src is not None:
            try:
                self._stash.remove(old)
            except ValueError:
                pass
            # Copies on one stream run in order: new's copy, queued after, covers old's source.
            same = new.stored.done_stream is not None and old.stored.done_stream is new.stored.done_stream
            self._drop_source(old, wait=not same)
        self._entries.discard(old)
        self._by_storage[old.key].remove(old)
        self._planner.on_released(old)
        old.stored.tier.free(old.stored)  # its pending copy is remembered by the tier

    def _offload(
        self, step: Step, storage, start: int, end: int, device: torch.device, version: int, where: str | None
    ):
        src = span_view(storage, start, end, device)
        # A planned place only when there is one: tiers written before places need not take it.
        stored = self.tier.store(src) if where is None else self.tier.store(src, where)
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
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += entry.nbytes
        self.stats.copied_bytes += entry.nbytes
        self._entries.add(entry)
        self._by_storage.setdefault(entry.key, []).append(entry)
        self._planner.on_saved(step, entry, new=True)
        if not stored.copy_finished():
            entry.keep_source(src, current_stream(device))
            self._stash.append(entry)
            self._trim_stash()
        return entry

    def _warn_budget(self) -> None:
        if not self._budget_warned:
            self._budget_warned = True
            warnings.warn(
                f"offloadkit: host-memory budget reached ({self.budget.describe()}); further "
                "activations stay on the device. Raise host_budget_bytes or add a disk tier.",
                RuntimeWarning,
                stacklevel=5,
            )

    def _trim_stash(self) -> None:
        stash = self._stash
        # Copies complete in order on the side stream: drop landed sources from the front.
        while stash and stash[0].stored.copy_finished():
            self._drop_source(stash.popleft(), wait=False)
        while len(stash) > self.max_fwd_stash_size:
            self._drop_source(stash.popleft(), wait=True)

    def _drop_source(self, entry: Entry, wait: bool) -> None:
        if wait:
            # The side stream may still read the source: its memory must not be reused on the
            # source's stream until the copy is done (GPU-side wait, no host sync).
            self._clock.wait(entry.src_stream, entry.stored.done, "forward", self.stats)
        entry.drop_source()

    def _flush_stash(self) -> None:
        while self._stash:
            self._drop_source(self._stash.popleft(), wait=True)


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
