"""Host memory for offloaded bytes: a few large (pinned) chunks, carved into exact-size blocks.

Why an arena and not per-size free lists: with variable-length batches (SFT without
packing) every step saves tensors of new sizes. Free lists keyed by size keep a buffer of
every size ever seen; page-locking and unlocking buffers to stay under a cap puts
``cudaHostRegister`` and host synchronisation into the pack hook. Here a handful of chunks
are page-locked once, blocks are carved best-fit from their free ranges and coalesce again
when released, so the memory held follows the largest step's need and, once that step has
been seen, nothing is registered or synchronised on the hot path.

Reuse safety without host waits: a block remembers the device copies (stream, event) that
may still read or write it. Device copies into a reused block are ordered after them on the
GPU (:meth:`HostBlock.order_device_use`); host writes into it (disk reads, CPU copies)
first wait for them on the host (:meth:`HostBlock.wait_host`), which only I/O threads and
CPU paths do.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from offloadkit.runtime.device import PAGE_SIZE, host_register, host_unregister
from offloadkit.storage.budget import HostMemoryBudget

__all__ = ["HostBlock", "HostBufferPool", "size_class"]

_MIN_CHUNK = 8 << 20
_MAX_CHUNK = 512 << 20


def size_class(nbytes: int) -> int:
    """Bytes a block of ``nbytes`` occupies: rounded up to whole pages (page-aligned blocks
    serve ``O_DIRECT`` I/O and keep every device copy's host side aligned)."""
    return max(PAGE_SIZE, -(-nbytes // PAGE_SIZE) * PAGE_SIZE)


def _prune(uses: list) -> list:
    # Completed copies no longer constrain reuse; a newer use on the same stream supersedes
    # an older one only when both are known to be in order, so keep distinct pending events.
    return [u for u in uses if not u[1].query()]


@dataclass(eq=False)
class HostBlock:
    """A host buffer (a slice of a chunk). ``uses`` holds the (stream, event) pairs of device
    copies that may still touch it."""

    buffer: torch.Tensor  # uint8, ``capacity`` bytes, host memory
    capacity: int
    pinned: bool
    uses: list = field(default_factory=list, repr=False)
    chunk: Any = field(default=None, repr=False)
    offset: int = 0

    def view(self, nbytes: int) -> torch.Tensor:
        return self.buffer[:nbytes]

    def note_use(self, stream, event) -> None:
        """A device copy on ``stream`` touching this block completes with ``event``."""
        # Events on one stream complete in order: the new one covers older ones on it.
        self.uses = [u for u in self.uses if u[0] != stream]
        self.uses.append((stream, event))

    def order_device_use(self, stream) -> None:
        """Make ``stream`` wait (on the GPU) for earlier copies on other streams."""
        for other, event in self.uses:
            if other != stream:
                stream.wait_event(event)

    def wait_host(self) -> None:
        """Block the host until no device copy touches this block (before host writes)."""
        for _, event in self.uses:
            event.synchronize()
        self.uses = []


@dataclass(eq=False)
class _Chunk:
    base: torch.Tensor
    capacity: int
    pinned: bool
    unregister: Any = None  # weakref.finalize: unregisters exactly once


@dataclass(eq=False)
class _Range:
    chunk: _Chunk
    offset: int
    size: int
    uses: list
    key: tuple = ()  # (size, seq) in the size index


class HostBufferPool:
    """Exact-size host blocks carved from a few large chunks, accounted against a
    :class:`HostMemoryBudget`.

    Args:
        pin_memory: page-lock chunks so device copies run asynchronously at full bandwidth.
        budget: shared host-memory budget; ``acquire`` returns None when it refuses.
        respect_cap: False for transient I/O buffers (disk staging): the budget's byte cap
            does not apply to them, its free-RAM guard does.
        grow_in_chunks: True (activations) grows by chunks with room to spare, which later
            blocks of other sizes reuse. False for blocks sized once at setup (streamed
            weights): each chunk is exactly its block, since a tail shorter than the next
            block would sit idle (32 layers of 416 MiB in 512 MiB chunks held 2 GiB for nothing).

    Example:
        >>> pool = HostBufferPool(pin_memory=False, budget=HostMemoryBudget())
        >>> block = pool.acquire(10_000)
        >>> pool.release(block)
        >>> pool.acquire(10_000).buffer.data_ptr() == block.buffer.data_ptr()
        True
    """

    def __init__(
        self, pin_memory: bool, budget: HostMemoryBudget, respect_cap: bool = True, grow_in_chunks: bool = True
    ) -> None:
        self.pin_memory = bool(pin_memory)
        self.budget = budget
        self.respect_cap = respect_cap
        self.grow_in_chunks = grow_in_chunks
        self._chunks: list[_Chunk] = []
        self._by_size: list[tuple] = []  # sorted (size, seq) keys of free ranges
        self._ranges: dict[tuple, _Range] = {}  # key -> range
        self._by_start: dict[tuple, _Range] = {}  # (id(chunk), offset) -> free range
        self._by_end: dict[tuple, _Range] = {}  # (id(chunk), end) -> free range
        self._seq = itertools.count()
        self._in_use = 0
        self._held = 0
        self._returns: deque[HostBlock] = deque()  # blocks finalizers gave back (see release_later)
        self._closed = False
        self._can_register = True
        self._lock = threading.Lock()
        self.allocations = 0  # chunks allocated (page-locked) so far
        self.reuses = 0  # blocks served from memory already held
        budget.register(self)

    # -- accounting ---------------------------------------------------------------------
    @property
    def bytes_held(self) -> int:
        """All bytes this pool holds, in use or idle."""
        return self._held

    @property
    def bytes_in_use(self) -> int:
        return self._in_use

    @property
    def bytes_idle(self) -> int:
        return self._held - self._in_use

    @property
    def chunks(self) -> int:
        return len(self._chunks)

    # -- public API ---------------------------------------------------------------------
    def acquire(self, nbytes: int) -> HostBlock | None:
        """A block of at least ``nbytes`` bytes, or None if the host budget refuses."""
        cap = size_class(nbytes)
        self._give_back_returns()
        block = self._acquire(cap)
        if block is None:
            # Idle memory cached by other pools on the same budget (outside our lock: they
            # take their own locks) can make room too.
            self.budget.reclaim(cap, requester=self)
            block = self._acquire(cap)
        self._give_back_returns()
        return block

    def release(self, block: HostBlock, last_use: tuple | None = None) -> None:
        """Return ``block``; ``last_use`` = (stream, event) of a device copy that may still use it."""
        if last_use is not None and last_use[1] is not None:
            block.note_use(*last_use)
        with self._lock:
            self._release_locked(block)
        self._give_back_returns()

    def release_later(self, block: HostBlock) -> None:
        """:meth:`release` for finalizers: they run on any thread, possibly inside this pool's
        own critical section (a garbage collection triggered there), so the block is queued and
        given back as soon as the lock is free (at the latest by the next call on the pool)."""
        self._returns.append(block)
        self._give_back_returns()

    def _release_locked(self, block: HostBlock) -> None:
        self._in_use -= block.capacity
        self._insert(block.chunk, block.offset, block.capacity, _prune(block.uses))
        if self._closed:
            self._trim_locked(None)

    def _give_back_returns(self) -> None:
        while self._returns and self._lock.acquire(blocking=False):
            try:
                while self._returns:
                    self._release_locked(self._returns.popleft())
            finally:
                self._lock.release()

    def trim(self, need: int | None = None) -> int:
        """Free chunks with nothing in use (all, or until the budget has ``need`` bytes of headroom)."""
        with self._lock:
            return self._trim_locked(need)

    def close(self) -> None:
        """Free idle chunks now and the rest as their blocks are released."""
        with self._lock:
            self._closed = True
            self._trim_locked(None)
        self._give_back_returns()

    # -- carving --------------------------------------------------------------------------
    def _acquire(self, cap: int) -> HostBlock | None:
        with self._lock:
            if self._closed:
                raise RuntimeError("HostBufferPool is closed")
            rng = self._best_fit(cap)
            if rng is None:
                chunk = self._new_chunk(cap)
                if chunk is None:
                    return None
                rng = self._take(self._by_start[(id(chunk), 0)])
            else:
                rng = self._take(rng)
                self.reuses += 1
            if rng.size > cap:  # the rest stays free, with the same pending copies
                self._insert(rng.chunk, rng.offset + cap, rng.size - cap, list(rng.uses))
            self._in_use += cap
            return HostBlock(
                rng.chunk.base[rng.offset : rng.offset + cap],
                cap,
                rng.chunk.pinned,
                uses=rng.uses,
                chunk=rng.chunk,
                offset=rng.offset,
            )

    def _best_fit(self, cap: int) -> _Range | None:
        i = bisect.bisect_left(self._by_size, (cap, -1))
        return self._ranges[self._by_size[i]] if i < len(self._by_size) else None

    def _take(self, rng: _Range) -> _Range:
        i = bisect.bisect_left(self._by_size, rng.key)
        del self._by_size[i]
        del self._ranges[rng.key]
        del self._by_start[(id(rng.chunk), rng.offset)]
        del self._by_end[(id(rng.chunk), rng.offset + rng.size)]
        return rng

    def _insert(self, chunk: _Chunk, offset: int, size: int, uses: list) -> None:
        """Add a free range, merged with free neighbours (their pending copies carry over)."""
        before = self._by_end.get((id(chunk), offset))
        if before is not None:
            self._take(before)
            offset, size, uses = before.offset, before.size + size, _prune(before.uses) + uses
        after = self._by_start.get((id(chunk), offset + size))
        if after is not None:
            self._take(after)
            size, uses = size + after.size, uses + _prune(after.uses)
        rng = _Range(chunk, offset, size, uses, key=(size, next(self._seq)))
        bisect.insort(self._by_size, rng.key)
        self._ranges[rng.key] = rng
        self._by_start[(id(chunk), offset)] = rng
        self._by_end[(id(chunk), offset + size)] = rng

    # -- chunks -----------------------------------------------------------------------------
    def _new_chunk(self, cap: int) -> _Chunk | None:
        # Grow by about an eighth of what is held (at least 8 MiB): few registrations, and at
        # most ~1/8 more held than the largest step needs.
        want = cap
        if self.grow_in_chunks:
            want = max(cap, min(_MAX_CHUNK, max(_MIN_CHUNK, -(-self._held // 8 // PAGE_SIZE) * PAGE_SIZE)))
        for size in dict.fromkeys((want, cap)):
            if self.budget.try_reserve(size, self.respect_cap):
                break
            # Idle chunks are the first thing to give back.
            self._trim_locked(size)
            if self.budget.try_reserve(size, self.respect_cap):
                break
        else:
            return None
        try:
            chunk = self._allocate(size)
        except Exception:
            self.budget.release(size)
            raise
        self._chunks.append(chunk)
        self._held += size
        self.allocations += 1
        self._insert(chunk, 0, size, [])
        return chunk

    def _trim_locked(self, need: int | None) -> int:
        freed = 0
        for chunk in sorted(self._chunks, key=lambda c: -c.capacity):
            if need is not None and self.budget.headroom() >= need:
                break
            rng = self._by_start.get((id(chunk), 0))
            if rng is None or rng.size != chunk.capacity:
                continue  # something in it is in use
            self._take(rng)
            for _, event in rng.uses:
                event.synchronize()  # a device copy may still touch it: never hand it back early
            if chunk.unregister is not None:
                chunk.unregister()
            self._chunks.remove(chunk)
            self._held -= chunk.capacity
            self.budget.release(chunk.capacity)
            freed += chunk.capacity
        return freed

    def _allocate(self, size: int) -> _Chunk:
        # Over-allocate one page so the chunk (and every block in it) is page-aligned and a
        # registered range owns whole pages exclusively.
        if not self.pin_memory or self._can_register:
            raw = torch.empty(size + PAGE_SIZE, dtype=torch.uint8)
            offset = (-raw.data_ptr()) % PAGE_SIZE
            base = raw[offset : offset + size]
            if not self.pin_memory:
                return _Chunk(base, size, pinned=False)
            if host_register(base.data_ptr(), size):
                chunk = _Chunk(base, size, pinned=True)
                chunk.unregister = weakref.finalize(chunk, host_unregister, base.data_ptr())
                return chunk
            self._can_register = False
            warnings.warn(
                "offloadkit: cudaHostRegister is unavailable; falling back to PyTorch's pinned "
                "allocator for host chunks",
                RuntimeWarning,
                stacklevel=4,
            )
        return _Chunk(torch.empty(size, dtype=torch.uint8, pin_memory=True), size, pinned=True)
