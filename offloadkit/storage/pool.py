"""Reusable host buffers for offloaded bytes.

Activation sizes repeat from step to step, so after one warm-up step every request is
served from the free lists: no new (pinned) allocation per tensor per step. Requests are
rounded to size classes with at most 1/16 slack so that slightly different sizes (for
example a variable sequence length) still share buffers.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from offloadkit.runtime.device import PAGE_SIZE, host_register, host_unregister
from offloadkit.storage.budget import HostMemoryBudget

__all__ = ["HostBlock", "HostBufferPool", "size_class"]

# Below this, page-locking each buffer costs more than PyTorch's own pinned allocator wastes.
_REGISTER_MIN_BYTES = 1 << 20


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its pool class: a page multiple, at most 1/16 above ``nbytes``."""
    if nbytes <= PAGE_SIZE:
        return PAGE_SIZE
    step = max(PAGE_SIZE, 1 << max(0, (nbytes - 1).bit_length() - 5))
    return -(-nbytes // step) * step


@dataclass(eq=False)
class HostBlock:
    """One host buffer. ``last_use`` is the (stream, event) of the last device copy that touched it."""

    buffer: torch.Tensor  # uint8, ``capacity`` bytes, host memory
    capacity: int
    pinned: bool
    registered_ptr: int | None = None
    last_use: tuple | None = field(default=None, repr=False)
    # Unregisters page-locked memory exactly once, also if the block is garbage-collected
    # without going back to the pool: a stale registration makes later ones at the same
    # addresses fail.
    unregister: object = field(default=None, repr=False)

    def view(self, nbytes: int) -> torch.Tensor:
        return self.buffer[:nbytes]


class HostBufferPool:
    """Size-class free lists of host buffers, accounted against a :class:`HostMemoryBudget`.

    Args:
        pin_memory: page-lock buffers so device copies run asynchronously at full bandwidth.
        budget: shared host-memory budget; ``acquire`` returns None when it refuses.
        respect_cap: False for transient I/O buffers (disk staging): the budget's byte cap
            does not apply to them, its free-RAM guard does.

    Example:
        >>> pool = HostBufferPool(pin_memory=False, budget=HostMemoryBudget())
        >>> block = pool.acquire(10_000)
        >>> pool.release(block)
        >>> pool.acquire(10_000) is block
        True
    """

    def __init__(self, pin_memory: bool, budget: HostMemoryBudget, respect_cap: bool = True) -> None:
        self.pin_memory = bool(pin_memory)
        self.budget = budget
        self.respect_cap = respect_cap  # False: transient I/O buffers, held to the free-RAM guard only
        self._free: dict[int, list[HostBlock]] = defaultdict(list)
        self._in_use = 0
        self._held = 0
        self._closed = False
        self._can_register = True
        self._lock = threading.Lock()
        self.allocations = 0
        self.reuses = 0
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

    # -- public API ---------------------------------------------------------------------
    def acquire(self, nbytes: int) -> HostBlock | None:
        """A buffer of at least ``nbytes`` bytes, or None if the host budget refuses."""
        cap = size_class(nbytes)
        block = self._acquire(cap)
        if block is None:
            # Idle buffers cached by other pools on the same budget (outside our lock:
            # they take their own locks) can make room too.
            self.budget.reclaim(cap, requester=self)
            block = self._acquire(cap)
        return block

    def _acquire(self, cap: int) -> HostBlock | None:
        with self._lock:
            if self._closed:
                raise RuntimeError("HostBufferPool is closed")
            free = self._free.get(cap)
            if free:
                block = free.pop()
                self._in_use += cap
                self.reuses += 1
                return block
            if not self.budget.try_reserve(cap, self.respect_cap):
                # Idle buffers of other sizes are the first thing to give back.
                self._trim_locked(cap)
                if not self.budget.try_reserve(cap, self.respect_cap):
                    return None
            try:
                block = self._allocate(cap)
            except Exception:
                self.budget.release(cap)
                raise
            self._held += cap
            self._in_use += cap
            self.allocations += 1
            return block

    def release(self, block: HostBlock, last_use: tuple | None = None) -> None:
        """Return ``block``; ``last_use`` = (stream, event) of the device copy that last used it."""
        with self._lock:
            block.last_use = last_use
            self._in_use -= block.capacity
            if self._closed:
                self._free_block(block)
            else:
                self._free[block.capacity].append(block)

    def trim(self, need: int | None = None) -> int:
        """Free idle buffers (all, or until the budget has ``need`` bytes of headroom)."""
        with self._lock:
            return self._trim_locked(need)

    def close(self) -> None:
        """Free idle buffers now and buffers still in use as they are released."""
        with self._lock:
            self._closed = True
            self._trim_locked(None)

    # -- internals ----------------------------------------------------------------------
    def _trim_locked(self, need: int | None) -> int:
        freed = 0
        for cap in sorted(self._free, reverse=True):
            blocks = self._free[cap]
            while blocks:
                if need is not None and self.budget.headroom() >= need:
                    return freed
                self._free_block(blocks.pop())
                freed += cap
        self._free = defaultdict(list, {c: b for c, b in self._free.items() if b})
        return freed

    def _free_block(self, block: HostBlock) -> None:
        if block.last_use is not None:
            # A device copy may still read or write this buffer: never hand it back early.
            block.last_use[1].synchronize()
        if block.unregister is not None:
            block.unregister()
        self._held -= block.capacity
        self.budget.release(block.capacity)

    def _allocate(self, cap: int) -> HostBlock:
        if not self.pin_memory:
            # Page-aligned, so the disk tier can use it for O_DIRECT I/O.
            raw = torch.empty(cap + PAGE_SIZE, dtype=torch.uint8)
            offset = (-raw.data_ptr()) % PAGE_SIZE
            return HostBlock(raw[offset : offset + cap], cap, pinned=False)
        if cap >= _REGISTER_MIN_BYTES and self._can_register:
            # Over-allocate one page so the registered range owns whole pages exclusively.
            raw = torch.empty(cap + PAGE_SIZE, dtype=torch.uint8)
            offset = (-raw.data_ptr()) % PAGE_SIZE
            buf = raw[offset : offset + cap]
            if host_register(buf.data_ptr(), cap):
                block = HostBlock(buf, cap, pinned=True, registered_ptr=buf.data_ptr())
                block.unregister = weakref.finalize(block, host_unregister, buf.data_ptr())
                return block
            self._can_register = False
            warnings.warn(
                "offloadkit: cudaHostRegister is unavailable; falling back to PyTorch's pinned "
                "allocator, which rounds host buffers up to powers of two",
                RuntimeWarning,
                stacklevel=3,
            )
        return HostBlock(torch.empty(cap, dtype=torch.uint8, pin_memory=True), cap, pinned=True)
