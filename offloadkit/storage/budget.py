"""Host-memory budget shared by every host-side tier (pinned RAM now, disk staging later).

The guard exists so that offloading never pushes a machine into swap or gets the
process OOM-killed: past the budget, callers keep tensors where they are (on the
accelerator) or place them on a slower tier.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import psutil

__all__ = ["HostMemoryBudget"]

_GiB = 1 << 30


CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
)


def _cgroup_available(files=CGROUP_FILES) -> int | None:
    """Bytes left under this process's cgroup memory limit (v2, then v1), or None."""
    for limit_file, usage_file in files:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None  # no limit set
        return int(limit) - usage
    return None


def _available_bytes() -> int:
    # In a container, the host's free RAM is not ours to take: the cgroup limit is.
    available = int(psutil.virtual_memory().available)
    cgroup = _cgroup_available()
    return available if cgroup is None else min(available, cgroup)


def _total_bytes() -> int:
    return int(psutil.virtual_memory().total)


class HostMemoryBudget:
    """Accounts host bytes held by offloadkit and refuses reservations past a limit.

    Two rules apply, both must hold for a reservation to succeed:

    * ``limit_bytes``: a hard cap on bytes held by everything sharing this budget
      (``None`` for no cap);
    * ``min_free_bytes``: the system must keep at least this much RAM available after
      the reservation. Checked against the live figure, so the guard adapts to other
      processes and to machines whose RAM grows as it is used. Defaults to the larger
      of 2 GiB and 10% of total RAM.

    Args:
        limit_bytes: hard cap, or None.
        min_free_bytes: RAM that must stay available, or None for the default.
        available_fn: returns available system RAM in bytes (injectable for tests).

    Example:
        >>> budget = HostMemoryBudget(limit_bytes=8 << 30)
        >>> budget.try_reserve(1 << 30)
        True
        >>> budget.release(1 << 30)
    """

    def __init__(
        self,
        limit_bytes: int | None = None,
        min_free_bytes: int | None = None,
        available_fn: Callable[[], int] | None = None,
    ) -> None:
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(
                f"host_budget_bytes={limit_bytes!r} is negative; pass a byte count >= 0 or None for no cap"
            )
        if min_free_bytes is not None and min_free_bytes < 0:
            raise ValueError(
                f"min_free_bytes={min_free_bytes!r} is negative; pass a byte count >= 0 or None for the default"
            )
        self.limit_bytes = limit_bytes
        self.min_free_bytes = (
            max(2 * _GiB, _total_bytes() // 10) if min_free_bytes is None else int(min_free_bytes)
        )
        self._available = available_fn or _available_bytes
        self._used = 0
        self._peak = 0
        self._refusals = 0
        self._lock = threading.Lock()
        self._pools: weakref.WeakSet = weakref.WeakSet()  # pools accounted here

    def register(self, pool) -> None:
        """Pools sharing this budget register so idle buffers of one can make room for another."""
        self._pools.add(pool)

    def reclaim(self, nbytes: int, requester=None) -> int:
        """Ask the other pools to give back idle buffers until ``nbytes`` fit; returns bytes freed."""
        freed = 0
        for pool in list(self._pools):
            if pool is requester:
                continue
            if self.headroom() >= nbytes:
                break
            freed += pool.trim(need=nbytes)
        return freed

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def peak_bytes(self) -> int:
        return self._peak

    @property
    def refusals(self) -> int:
        return self._refusals

    def headroom(self) -> int:
        """Bytes that could be reserved right now."""
        by_free = self._available() - self.min_free_bytes
        if self.limit_bytes is None:
            return max(0, by_free)
        return max(0, min(by_free, self.limit_bytes - self._used))

    def try_reserve(self, nbytes: int, respect_cap: bool = True) -> bool:
        """Reserve ``nbytes``. ``respect_cap=False`` is for transient I/O buffers (disk
        staging, bounded by their own in-flight limit): only the free-RAM guard applies."""
        with self._lock:
            if respect_cap and self.limit_bytes is not None and self._used + nbytes > self.limit_bytes:
                self._refusals += 1
                return False
            if self._available() - nbytes < self.min_free_bytes:
                self._refusals += 1
                return False
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes
            if self._used < 0:  # a bookkeeping bug must not go unnoticed
                raise RuntimeError(f"HostMemoryBudget released more than reserved ({self._used} bytes)")

    def describe(self) -> str:
        cap = "none" if self.limit_bytes is None else f"{self.limit_bytes / _GiB:.2f} GiB"
        return (
            f"host budget: {self._used / _GiB:.2f} GiB held (peak {self._peak / _GiB:.2f}), "
            f"cap {cap}, keep {self.min_free_bytes / _GiB:.2f} GiB free"
        )
