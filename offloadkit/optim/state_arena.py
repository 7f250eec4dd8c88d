"""One GPU buffer that optimizer state fetched in backward is carved from, as a ring.

State comes to the GPU in update order and leaves in the same order once its copy back is
done. Given to the caching allocator one parameter at a time, those buffers (tens to hundreds
of MiB each, of a few sizes) interleave with gradients and the recompute's temporaries, and
the allocator keeps the gaps they leave: a 3B full fine-tune with the chunked loss reserved
1.42x what it allocated, with 9 GiB free in pieces between live state buffers. Here the state
of one backward pass lives in one allocation, reused in order: a buffer's bytes are taken
again once its copy back has landed (the next copy in waits for that on the device, not the
host).

:class:`Ring` is the bookkeeping alone (offsets, which tenants may be overwritten and after
what), testable without a GPU; :class:`StateArena` holds the device buffer; :class:`RingSize`
measures how large the next pass's must be.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ALIGN", "ArenaStats", "Ring", "RingSize", "Slot", "StateArena"]

# Every carved tensor starts on this boundary (fused optimizer kernels read 16-byte vectors;
# 512 matches the allocator's own rounding).
ALIGN = 512


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(eq=False)
class Slot:
    """Bytes ``[start, end)`` of the ring; ``done`` is None while its tenant is in use, else
    what the next tenant of these bytes must follow (the copy back, or the copy in of state
    fetched and never used)."""

    start: int
    end: int
    done: Any = None
    released: bool = False


Carved = tuple[dict[str, torch.Tensor], Slot, list]  # tensors, their slot, what to follow first


@dataclass
class ArenaStats:
    """Counts over one arena's life: states carved from the ring, states that found no room
    (the oldest tenant still in use) and were given to the allocator instead, and the times
    the ring wrapped around."""

    carved: int = 0
    missed: int = 0
    wrapped: int = 0


class Ring:
    """First in, first out placement of byte ranges in ``capacity`` bytes.

    ``take`` places after the newest tenant, reclaiming the oldest ones that were released;
    it never passes a tenant still in use (then it returns None, and the caller allocates
    elsewhere). Released tenants behind one in use wait for it to be released too.

    Every slot's first writer runs on one stream, in the order of ``take``: the completions a
    take returns are all those of the tenants it reclaimed, the ones whose bytes it does not
    cover included, since that stream's wait then orders every later writer as well.
    """

    def __init__(self, capacity: int, stats: ArenaStats | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity={capacity!r} is invalid; use a byte count > 0")
        self.capacity = capacity
        self.slots: deque[Slot] = deque()  # oldest first
        self._reclaimed: list = []  # completions of reclaimed tenants no writer has followed yet
        self.stats = stats if stats is not None else ArenaStats()

    def take(self, nbytes: int) -> tuple[Slot, list] | None:
        """A slot of ``nbytes`` (rounded up to :data:`ALIGN`) and the completions its first
        writer must follow (those of the tenants it displaces), or None without room."""
        size = aligned(max(nbytes, 1))
        if size > self.capacity:
            self.stats.missed += 1
            return None
        while True:
            start = self._room_for(size)
            if start is not None:
                break
            if not self.slots or not self.slots[0].released:
                self.stats.missed += 1
                return None
            oldest = self.slots.popleft()
            if oldest.done is not None:
                # Followed by the next slot placed (this take's, or a later one's if it fails).
                self._reclaimed.append(oldest.done)
        if self.slots and start < self.slots[-1].end:
            self.stats.wrapped += 1
        slot = Slot(start, start + size)
        self.slots.append(slot)
        self.stats.carved += 1
        follow, self._reclaimed = self._reclaimed, []
        return slot, follow

    def _room_for(self, size: int) -> int | None:
        if not self.slots:
            return 0
        tail, head = self.slots[0].start, self.slots[-1].end
        if self.slots[-1].start >= tail:  # not wrapped: free is [head, capacity) and [0, tail)
            if head + size <= self.capacity:
                return head
            return 0 if size <= tail else None
        return head if head + size <= tail else None  # wrapped: free is [head, tail)

    @staticmethod
    def release(slot: Slot, done: Any) -> None:
        """The tenant of ``slot`` is done with it once ``done`` completes."""
        slot.done, slot.released = done, True

    def live_bytes(self) -> int:
        return sum(s.end - s.start for s in self.slots)


class StateArena:
    """A :class:`Ring` over one uint8 buffer on ``device``, allocated on the stream current
    when it is made (the compute stream: its memory returns there when the arena goes)."""

    def __init__(self, capacity: int, device: torch.device, stats: ArenaStats | None = None) -> None:
        self.ring = Ring(aligned(capacity), stats)
        self.buffer = torch.empty(self.ring.capacity, dtype=torch.uint8, device=device)

    def carve(self, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> Carved | None:
        """One tensor per key, each :data:`ALIGN`-aligned in one slot; with the completions to
        follow before writing them. None without room."""
        sizes = {k: aligned(torch.Size(shape).numel() * dtype.itemsize) for k, (shape, dtype) in shapes.items()}
        got = self.ring.take(sum(sizes.values()))
        if got is None:
            return None
        slot, follow = got
        out, at = {}, slot.start
        for k, (shape, dtype) in shapes.items():
            n = torch.Size(shape).numel() * dtype.itemsize
            out[k] = self.buffer[at : at + n].view(dtype).view(shape)
            at += sizes[k]
        return out, slot, follow


class RingSize:
    """How many bytes of state a pass held on the GPU at once: the next pass's arena.

    Counted over the states of at most ``item_limit`` bytes (a model's few largest
    parameters, its embedding table's state: 4.7 GB of a 3B model's in fp32, would size a
    ring mostly idle; they come from the allocator), from when a state's buffer is taken
    until its copy back has completed (``done.query()``, in the order the copies were
    queued), as the allocator would hold it.
    """

    def __init__(self, item_limit: int) -> None:
        self.item_limit = item_limit
        self.live = 0
        self.high = 0
        self.largest = 0
        self._back: deque = deque()  # (completion, bytes) of copies back not seen done

    def counts(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.item_limit

    def taken(self, nbytes: int) -> None:
        self._settle()
        self.live += nbytes
        self.high = max(self.high, self.live)
        self.largest = max(self.largest, nbytes)

    def stored(self, done: Any, nbytes: int) -> None:
        self._back.append((done, nbytes))

    def dropped(self, nbytes: int) -> None:
        self.live -= nbytes

    def _settle(self) -> None:
        while self._back and self._back[0][0].query():
            self.live -= self._back.popleft()[1]

    def end_pass(self) -> int:
        """The next pass's arena in bytes (0: no state counted): the most held at once, and
        one more of the largest state for the room a wrap leaves unused."""
        size = self.high + self.largest if self.high else 0
        self.high = self.largest = 0
        return size
