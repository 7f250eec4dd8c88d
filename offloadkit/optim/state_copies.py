"""Optimizer state between pinned host memory and the GPU, on the process's copy streams.

A parameter's state (moments, fp32 master copy) comes to the GPU on the bulk host->device stream,
is updated on the compute stream, and goes back on the device->host stream while backward goes
on. The order in which parameters were updated in the last pass is remembered, so that while
one parameter is updated the state of the next ones is already on its way in. Every copy goes
through :func:`offloadkit.transfer.queue_copy`: back in the activations' device->host queue, in
through the bulk host->device queue, since each copy in waits for the compute stream and a
block input's prefetch must not wait behind it.

How far ahead: by default a byte window. Given the groups of parameters updated together (one
decoder layer's: :meth:`StateCopies.set_groups`), the look-ahead counts groups, as the
activations' prefetch counts blocks, within the same byte window: a byte window alone fetches
as much of the model's state as it holds at the first update of backward, and the block inputs'
prefetches then share the link with all of it (on a small model, the whole state: the GPU
waited 17 ms of a 77 ms step for its activations).

GPU memory: the states fetched ahead and those still being copied back are bounded by
``window_bytes`` each; past it the host waits for the oldest copy back (the GPU keeps running
the work already queued). From the second pass on, a pass's state buffers are carved in order
from one allocation (:mod:`offloadkit.optim.state_arena`), sized by what the last pass held
at once (:class:`~offloadkit.optim.state_arena.RingSize`), made on the compute stream at the
pass's first fetch and given back at its end; one buffer per parameter from the allocator
left the gaps between them reserved. The first pass, a state larger than a quarter of the
window (an embedding table's) and one that finds the ring's oldest tenant still in use take
theirs from the allocator.

Parameters on several GPUs are updated from one autograd thread per device: every method
holds one lock, and a parameter between its fetch and its store is never fetched ahead (its
host bytes are about to be rewritten).
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

import torch

from offloadkit.optim.state_arena import ArenaStats, Ring, RingSize, Slot, StateArena, aligned
from offloadkit.storage.pool import HostBlock
from offloadkit.transfer import copy_stream, queue_copy
from offloadkit.transfer.completion import order_after
from offloadkit.transfer.prefetch import Ahead, Lane, PrefetchScheduler, Status

__all__ = ["StateCopies"]

# States of at most this share of the copy window go through the pass's arena; larger ones
# (a model's embedding table's) come from the allocator, as there are few of them.
RING_ITEM_SHARE = 4

# (host state of a parameter, the keys that travel); None when it has none yet
Lookup = Callable[[torch.Tensor], "tuple[dict, tuple[str, ...]] | None"]


def _aligned_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(aligned(t.nbytes) for t in tensors.values())


class StateCopies:
    """Fetch, prefetch and write back the host-resident state of CUDA parameters.

    Args:
        lookup: ``lookup(p)`` returns ``(state, keys)``: the parameter's state dict and the
            keys of its host tensors that travel, or None when it has no state yet.
        window_bytes: GPU bytes of state fetched ahead, and of state still being copied
            back, each at most (at least one parameter's).
        scheduler: the :class:`~offloadkit.transfer.PrefetchScheduler` the look-ahead runs
            in, shared with activations and streamed weights (None: one of its own).
    """

    def __init__(self, lookup: Lookup, window_bytes: int, scheduler: PrefetchScheduler | None = None) -> None:
        if isinstance(window_bytes, bool) or not isinstance(window_bytes, int) or window_bytes < 0:
            raise ValueError(f"copy_window_bytes={window_bytes!r} is invalid; use a byte count >= 0")
        self.lookup = lookup
        self.window_bytes = window_bytes
        self.scheduler, self._lane = self._lane_in(scheduler)
        self._order: list[torch.Tensor] = []  # the last pass's update order
        self._position: dict[int, int] = {}
        self._seen: list[torch.Tensor] = []  # this pass's, so far
        self._seen_ids: set[int] = set()
        # id(p) -> (key -> device tensor, copy done, bytes, the stream its memory was allocated on)
        self._ahead: dict[int, tuple[dict[str, torch.Tensor], torch.cuda.Event, int, torch.cuda.Stream]] = {}
        self._back: collections.deque = collections.deque()  # (event, bytes) of copies back
        self._back_bytes = 0
        self._blocks: dict[tuple[int, str], HostBlock] = {}
        self._updating: set[int] = set()  # fetched, not yet stored
        self._devices: dict[int, torch.device] = {}  # where each parameter was last updated
        self._group: dict[int, int] = {}  # id(p) -> the group of parameters updated with it
        self._arenas: dict[torch.device, StateArena] = {}  # this pass's, by device
        self._slots: dict[int, Slot] = {}  # id(p) -> its state's slot, fetched and not yet stored
        # Per device: the pass's arena size (measured over the last pass; 0: none) and its measure.
        self._ring_bytes: dict[torch.device, int] = {}
        self._ring_sizes: dict[torch.device, RingSize] = {}
        self._counted: dict[int, tuple[torch.device, int]] = {}  # id(p) -> where its state counts
        self.arena_stats = ArenaStats()
        self._ahead_rule = self._window_rule()
        self._lock = threading.RLock()

    def _lane_in(self, scheduler: PrefetchScheduler | None) -> tuple[PrefetchScheduler, Lane]:
        if scheduler is not None and not isinstance(scheduler, PrefetchScheduler):
            raise ValueError(f"scheduler={scheduler!r} is invalid; pass a transfer.PrefetchScheduler or None")
        scheduler = scheduler if scheduler is not None else PrefetchScheduler()
        # Each walk passes its rule (set_groups); the lane's own is the byte window.
        return scheduler, scheduler.lane("optimizer state", self._fetch_ahead, self._window_rule())

    def _window_rule(self) -> Ahead:
        """The byte window alone: parameters in the learned update order, each its own group."""
        return Ahead(min_bytes=self.window_bytes, max_bytes=self.window_bytes)

    def set_groups(self, groups, ahead: int) -> None:
        """Look ahead by ``ahead`` groups of parameters updated together (the rest of the
        current one counts as one), within the byte window; ``groups`` an iterable of
        iterables of parameters (a parameter in none is a group of its own). ``ahead=0`` or no
        groups: the byte window alone."""
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(f"ahead={ahead!r} is invalid; use a count of groups >= 0")
        with self._lock:
            self._group = {id(p): i for i, group in enumerate(groups) for p in group}
            use_groups = bool(self._group) and ahead > 0
            self._ahead_rule = Ahead(groups=ahead, max_bytes=self.window_bytes) if use_groups else self._window_rule()

    def use_scheduler(self, scheduler: PrefetchScheduler | None) -> None:
        """Move the look-ahead into ``scheduler`` (None: one of its own): what was fetched ahead
        is released, and the old scheduler no longer counts this lane."""
        with self._lock:
            self._drop_ahead()
            self._lane.reset()
            self._lane.close()
            self.scheduler, self._lane = self._lane_in(scheduler)

    # -- host blocks ----------------------------------------------------------------------
    def _block(self, p: torch.Tensor, key: str, host: torch.Tensor) -> HostBlock:
        """The block that remembers which copies still touch ``host`` (kept across steps: a
        fetch must follow the last step's copy back of the same bytes)."""
        block = self._blocks.get((id(p), key))
        if block is None or block.buffer.data_ptr() != host.data_ptr():
            flat = host.view(-1).view(torch.uint8)
            block = self._blocks[(id(p), key)] = HostBlock(flat, flat.numel(), host.is_pinned())
        return block

    # -- in -----------------------------------------------------------------------------
    def _queue_in(self, p: torch.Tensor, state: dict, keys: tuple[str, ...], device: torch.device):
        # Not the "h2d" queue: this copy waits for the compute stream (below), and a block input
        # or a streamed layer queued behind it would wait for that compute work too.
        h2d = copy_stream(device, "h2d_bulk")
        compute = torch.cuda.current_stream(device)
        gpu, slot, follow = self._allocate(state, keys, device)
        if slot is not None:
            self._slots[id(p)] = slot
        nbytes, size = _aligned_bytes(gpu), self._size_on(device)
        if size.counts(nbytes):
            size.taken(nbytes)
            self._counted[id(p)] = (device, nbytes)
        for completion in follow:
            order_after(h2d, completion)  # the bytes' last tenant has been copied back
        # No record_stream(h2d): its free would then wait for every copy queued on h2d by then
        # (the whole window fetched ahead), holding about a window more of memory. A fetch in
        # use is ordered by compute's wait in fetch(); one dropped unused by _drop_ahead().
        done = None
        for i, k in enumerate(keys):
            # After the compute work queued so far: it may still use this memory's last tenant.
            after = compute if i == 0 else None
            done = queue_copy(gpu[k], state[k], stream=h2d, block=self._block(p, k, state[k]), after=after)
        return gpu, done, sum(t.nbytes for t in gpu.values()), compute

    def _allocate(self, state: dict, keys: tuple[str, ...], device: torch.device):
        """The device tensors of one parameter's state: from this pass's arena where it has
        room, with the completions the copy in must follow; else from the allocator."""
        arena = None
        if self._size_on(device).counts(sum(aligned(state[k].nbytes) for k in keys)):
            arena = self._arenas.get(device)
            if arena is None and self._ring_bytes.get(device):
                # On the compute stream, as fetched activations are: the memory returns there.
                with torch.cuda.device(device):
                    arena = self._arenas[device] = StateArena(self._ring_bytes[device], device, self.arena_stats)
        carved = arena.carve({k: (state[k].shape, state[k].dtype) for k in keys}) if arena is not None else None
        if carved is not None:
            return carved
        return {k: torch.empty(state[k].shape, dtype=state[k].dtype, device=device) for k in keys}, None, []

    def _size_on(self, device: torch.device) -> RingSize:
        size = self._ring_sizes.get(device)
        if size is None:
            size = self._ring_sizes[device] = RingSize(self.window_bytes // RING_ITEM_SHARE)
        return size

    def fetch(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The GPU copies of ``p``'s travelling state, usable on the current stream; the
        states that come next in the learned order are queued to follow.

        Returns:
            key -> device tensor.
        """
        with self._lock:
            return self._fetch(p)

    def _fetch(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        found = self.lookup(p)
        assert found is not None, "fetch() of a parameter without state"
        state, keys = found
        if id(p) in self._updating:
            self._abandon(id(p))  # fetched before and never stored: that update raised
        if id(p) in self._seen_ids:
            self._end_pass()  # a parameter updated again: a new pass began without step()
        got = self._ahead.pop(id(p), None)
        if got is not None:
            self._lane.settle(got[2])  # in use: it leaves the look-ahead window
        else:
            got = self._queue_in(p, state, keys, p.device)
        gpu, done, _, _ = got
        compute = torch.cuda.current_stream(p.device)
        compute.wait_event(done)  # the update reads what the copy wrote
        self._updating.add(id(p))
        # Where it is updated: a streamed weight fetched ahead while its block rests in a file
        # is a CPU tensor then, and its state must still come to this device.
        self._devices[id(p)] = p.device
        self._seen.append(p)
        self._seen_ids.add(id(p))
        at = self._position.get(id(p))
        if at is not None:
            self.scheduler.prefetch(self._lane, self._upcoming(self._order[at + 1 :]), self._ahead_rule)
        return gpu

    def _upcoming(self, order: list[torch.Tensor]):
        for q in order:
            group = self._group.get(id(q))
            got = self._ahead.get(id(q))
            if got is not None:
                yield q, got[2], group, Status.HERE
                continue
            found = None if id(q) in self._updating else self.lookup(q)
            if found is None:
                yield q, 0, group, Status.SKIP  # being updated, or no state yet (its first update creates it)
                continue
            state, keys = found
            yield (q, found), sum(state[k].nbytes for k in keys), group, Status.FETCH

    def _fetch_ahead(self, item) -> None:
        q, (state, keys) = item
        self._ahead[id(q)] = self._queue_in(q, state, keys, self._devices[id(q)])

    # -- out ----------------------------------------------------------------------------
    def store(self, p: torch.Tensor, gpu: dict[str, torch.Tensor]) -> None:
        """Queue the copies of ``gpu`` back into ``p``'s host state, after the update queued
        on the current stream."""
        with self._lock:
            self._store(p, gpu)

    def _store(self, p: torch.Tensor, gpu: dict[str, torch.Tensor]) -> None:
        found = self.lookup(p)
        assert found is not None
        state, _ = found
        compute = torch.cuda.current_stream(p.device)
        d2h = copy_stream(p.device, "d2h")
        updated = compute.record_event()  # the copies back read what the update wrote
        done = None
        for key, t in gpu.items():
            t.record_stream(d2h)  # released by the caller; the copy back still reads it
            done = queue_copy(state[key], t, stream=d2h, block=self._block(p, key, state[key]), after=updated)
        self._updating.discard(id(p))
        slot = self._slots.pop(id(p), None)
        if slot is not None:
            Ring.release(slot, done)  # its bytes are taken again once the copy back has read them
        counted = self._counted.pop(id(p), None)  # None: made by the update (SGD's first momentum)
        if counted is not None:
            self._ring_sizes[counted[0]].stored(done, counted[1])
        nbytes = sum(t.nbytes for t in gpu.values())
        self._back.append((done, nbytes))
        self._back_bytes += nbytes
        # Backpressure: state waiting to go back holds GPU memory until its copy is done.
        while self._back_bytes > self.window_bytes and len(self._back) > 1:
            event, size = self._back.popleft()
            event.synchronize()
            self._back_bytes -= size

    # -- passes -------------------------------------------------------------------------
    def end_pass(self) -> None:
        """The updates of one optimizer step are done: remember their order, and release
        what was fetched for parameters that were not updated (and for those whose update
        raised: none is still being updated now)."""
        with self._lock:
            for key in list(self._updating):
                self._abandon(key)
            self._end_pass()

    def _end_pass(self) -> None:
        if self._seen:
            self._order = self._seen
            self._position = {id(q): i for i, q in enumerate(self._order)}
        self._seen = []
        self._seen_ids = set()
        self._drop_ahead()
        for device, size in self._ring_sizes.items():
            self._ring_bytes[device] = size.end_pass() or self._ring_bytes.get(device, 0)
        self._lane.reset()  # what was fetched ahead and not updated is released here
        self._drop_arenas()

    def _abandon(self, key: int) -> None:
        """Forget a fetch whose update raised before its store: its bytes leave the ring's
        measure, and its slot is free once the compute stream's work queued so far is done (the
        next copy in follows that work)."""
        self._updating.discard(key)
        counted = self._counted.pop(key, None)
        if counted is not None:
            self._ring_sizes[counted[0]].dropped(counted[1])
        slot = self._slots.pop(key, None)
        if slot is not None:
            Ring.release(slot, None)

    def _drop_arenas(self) -> None:
        """Give this pass's arenas back: copies back still reading them hold them (each stored
        state was ``record_stream``'ed on the device->host stream), and a state being updated
        on another thread keeps its own view."""
        self._arenas.clear()
        self._slots = {k: s for k, s in self._slots.items() if k in self._updating}

    def _drop_ahead(self) -> None:
        """Release the states fetched ahead and not used: their memory returns to the stream
        that allocated it once their copies in are done (ordered there, not waited for)."""
        for key, (_, done, _, allocated_on) in self._ahead.items():
            allocated_on.wait_event(done)
            counted = self._counted.pop(key, None)
            if counted is not None:
                self._ring_sizes[counted[0]].dropped(counted[1])
            slot = self._slots.pop(key, None)
            if slot is not None:
                Ring.release(slot, done)  # never used: its bytes are free once the copy in is done
        self._ahead.clear()

    def reset(self) -> None:
        """Forget everything tied to the current host state (it is being replaced): states
        fetched ahead, the host blocks (they hold the old tensors), the learned order."""
        with self._lock:
            self.wait_all()
            self._drop_ahead()
            self._lane.reset()
            self._blocks.clear()
            self._updating.clear()
            self._drop_arenas()
            self._ring_bytes, self._ring_sizes, self._counted = {}, {}, {}
            self._devices.clear()
            self._order, self._position, self._seen, self._seen_ids = [], {}, [], set()

    def wait_all(self) -> None:
        """Block the host until every copy back has landed (before the host reads the state)."""
        with self._lock:
            while self._back:
                event, _ = self._back.popleft()
                event.synchronize()
            self._back_bytes = 0
