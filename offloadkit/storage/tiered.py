"""RAM first, disk past the host-memory budget: the newest entries stay in RAM.

Backward needs the most recently saved tensors first, so when RAM runs short the oldest
RAM entries are demoted: their host buffers are written to disk as they are (no extra
copy) and given back once written. Demotion starts in the background as soon as the RAM
headroom drops below a reserve, so a new entry rarely waits for it; when it must (the
disk is slower than the forward pass), the store blocks until room is made.

A planned place overrides the order: an entry placed on disk is demoted as soon as it is
stored (its RAM buffer is written out as it is, and given back: no staging buffer is held
for it), and one placed in RAM stays there (it is never demoted; when RAM has no room for
it, the demotions under way and unplanned entries make the room, then the disk takes it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from offloadkit.defaults import PREFETCH_FROM_DISK
from offloadkit.storage.base import Loaded, Stored
from offloadkit.storage.disk import DiskTier
from offloadkit.storage.host import HostTier
from offloadkit.storage.pool import size_class

__all__ = ["TieredTier", "TieredStats", "RESERVE_BYTES", "RESERVE_CAP_DIVISOR"]

# RAM headroom below which demotion starts in the background, by default; at most
# ``cap // RESERVE_CAP_DIVISOR`` of a capped RAM budget (the planner leaves this room free).
RESERVE_BYTES = 512 << 20
RESERVE_CAP_DIVISOR = 4


@dataclass
class TieredStats:
    ram_entries: int = 0
    disk_entries: int = 0  # stored straight to disk
    demoted_entries: int = 0
    demoted_bytes: int = 0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(eq=False)
class _Place:
    inner: Stored  # where the bytes are now
    in_ram: bool
    demotion: Stored | None = None  # the disk copy being written
    freed: bool = False


class TieredTier:
    """Host RAM up to the budget, then disk.

    Args:
        ram: the RAM tier (its pool's budget is the RAM budget).
        disk: the disk tier.
        reserve_bytes: start demoting in the background when RAM headroom falls below this
            (at most a quarter of the RAM budget's cap).
    """

    name = "tiered"
    default_prefetch = PREFETCH_FROM_DISK  # what comes back from disk sets the pace (see DiskTier)

    def __init__(self, ram: HostTier, disk: DiskTier, reserve_bytes: int = RESERVE_BYTES) -> None:
        self.ram, self.disk = ram, disk
        self.pools = (ram.pool, disk.pool)
        cap = ram.pool.budget.limit_bytes
        self.reserve_bytes = reserve_bytes if cap is None else min(reserve_bytes, cap // RESERVE_CAP_DIVISOR)
        self.stats = TieredStats()
        self._in_ram: OrderedDict[int, Stored] = OrderedDict()  # oldest first
        self._demoting: dict[int, Stored] = {}
        self._lock = threading.Condition()

    @property
    def budget(self):
        return self.ram.pool.budget

    def _room(self) -> int:
        # Idle buffers in the RAM pool are reusable room too (the budget counts them as held).
        return self.budget.headroom() + self.ram.pool.bytes_idle

    def store(self, src: torch.Tensor, where: str | None = None) -> Stored | None:
        need = size_class(src.numel())
        inner = self.ram.store(src)
        if inner is None:
            self._make_room(need, wait=True)
            inner = self.ram.store(src)
        if inner is None:
            inner = self.disk.store(src)
            if inner is None:
                return None
            self.stats.disk_entries += 1
            return Stored(
                tier=self,
                nbytes=inner.nbytes,
                device=inner.device,
                done=inner.done,
                done_stream=inner.done_stream,
                payload=_Place(inner, in_ram=False),
            )
        outer = Stored(
            tier=self,
            nbytes=inner.nbytes,
            device=inner.device,
            done=inner.done,
            done_stream=inner.done_stream,
            payload=_Place(inner, in_ram=True),
        )
        with self._lock:
            self.stats.ram_entries += 1
            if where == "disk":
                self._demote(outer)  # now (a full disk puts it back among the candidates)
            elif where != "ram":  # a planned RAM entry is never a candidate for demotion
                self._in_ram[id(outer)] = outer
        if self._room() < self.reserve_bytes:
            self._make_room(self.reserve_bytes, wait=False)
        return outer

    def load(self, stored: Stored) -> Loaded:
        with self._lock:
            place: _Place = stored.payload
            if place.in_ram:
                # Still valid during a demotion; held under the lock so the demotion cannot
                # give the block back before this copy is queued (and recorded as its last use).
                return self.ram.load(place.inner)
            inner = place.inner
        return self.disk.load(inner)

    def free(self, stored: Stored) -> None:
        with self._lock:
            place: _Place = stored.payload
            self._in_ram.pop(id(stored), None)
            place.freed = True
            if id(stored) in self._demoting:
                return  # the demotion's completion lets both copies go
        if place.in_ram:
            self.ram.free(place.inner)
        else:
            self.disk.free(place.inner)

    def host_bytes(self) -> int:
        return sum(pool.bytes_held for pool in self.pools)

    def host_bytes_in_use(self) -> int:
        return sum(pool.bytes_in_use for pool in self.pools)

    def bytes_on_disk(self) -> int:
        return self.disk.bytes_on_disk()

    def stats_dict(self) -> dict:
        return {"tiered": self.stats.as_dict(), **self.disk.stats_dict()}

    def reset_stats(self) -> None:
        self.stats = TieredStats()
        self.ram.reset_stats()
        self.disk.reset_stats()

    def close(self) -> None:
        self.disk.close()
        self.ram.close()

    # -- demotion ----------------------------------------------------------------------------
    def _make_room(self, need: int, wait: bool) -> None:
        """Demote the oldest RAM entries until ``need`` bytes are (or will be) free."""
        with self._lock:
            pending = sum(s.payload.inner.payload.capacity for s in self._demoting.values())
            candidates = len(self._in_ram)
            while self._room() + pending < need and candidates:
                candidates -= 1
                _, outer = self._in_ram.popitem(last=False)
                if self._demote(outer):
                    pending += outer.payload.inner.payload.capacity
                else:
                    break  # the disk is full: nothing more can move
            if wait:
                while self._demoting and self._room() < need:
                    self._lock.wait()

    def _demote(self, outer: Stored) -> bool:
        place: _Place = outer.payload
        ram_stored = place.inner
        block = ram_stored.payload

        def done(ok: bool) -> None:
            with self._lock:
                self._demoting.pop(id(outer), None)
                disk_stored, place.demotion = place.demotion, None
                if ok and not place.freed:
                    place.inner, place.in_ram = disk_stored, False
                    self.stats.demoted_entries += 1
                    self.stats.demoted_bytes += ram_stored.nbytes
                if ok:
                    # Before waking a store waiting for this room (it would find none yet).
                    self.ram.pool.release(block)  # carries the loads of the RAM copy queued before
                    ram_stored.payload = None
                self._lock.notify_all()
            if ok:
                if place.freed:
                    self.disk.free(disk_stored, wait=False)  # called from the write job itself
            else:
                self.disk.free(disk_stored, wait=False)  # give the extent back; the bytes stay in RAM
                if place.freed:
                    self.ram.free(ram_stored)

        disk_stored = self.disk.adopt(block, ram_stored.nbytes, ram_stored.device, ram_stored.done, self.ram.pool, done)
        if disk_stored is None:
            self._in_ram[id(outer)] = outer  # no room on disk either: it stays in RAM
            self._in_ram.move_to_end(id(outer), last=False)
            return False
        place.demotion = disk_stored
        self._demoting[id(outer)] = outer
        return True
