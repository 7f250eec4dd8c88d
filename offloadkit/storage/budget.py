"""Host-memory budget shared by every host-side tier (pinned RAM now, disk staging later).

The guard exists so that offloading never pushes a machine into swap or gets the
process OOM-killed: past the budget, callers keep tensors where they are (on the
accelerator) or place them on a slower tier.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Callable

import psutil

from offloadkit.runtime.ranks import local_world_size

__all__ = ["HostMemoryBudget", "cgroup_available", "cgroup_limits"]

_GiB = 1 << 30


CGROUP_ROOT = "/sys/fs/cgroup"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _own_cgroups(proc_cgroup: str) -> tuple[str | None, str | None]:
    """This process's cgroup path for v2 (``0::/path``) and for v1's memory controller."""
    v2 = v1 = None
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _reclaimable(directory: str, stat_keys: tuple[str, str, str]) -> int:
    """Page cache the kernel can drop before it OOM-kills (counted in a cgroup's usage):
    inactive file pages, less those still dirty or under writeback."""
    stats = {}
    for line in (_read(os.path.join(directory, "memory.stat")) or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            stats[key] = int(value)
    inactive, dirty, writeback = (stats.get(k, 0) for k in stat_keys)
    return max(0, inactive - dirty - writeback)


def _limit_and_left(directory: str, names: tuple) -> tuple[int, int] | None:
    limit_name, usage_name, stat_keys = names
    limit, usage = _read(os.path.join(directory, limit_name)), _read(os.path.join(directory, usage_name))
    if limit is None or usage is None or not limit.isdigit() or not usage.isdigit():
        return None  # "max", missing, or unreadable: no limit at this level
    if int(limit) >= 1 << 60:
        return None  # v1 writes "no limit" as a huge number
    used = max(0, int(usage) - _reclaimable(directory, stat_keys))
    return int(limit), int(limit) - used


def _levels(root: str, path: str):
    """``root/path`` and each of its ancestors up to ``root``."""
    parts = [p for p in path.strip("/").split("/") if p]
    for i in range(len(parts), -1, -1):
        yield os.path.join(root, *parts[:i])


_V2 = ("memory.max", "memory.current", ("inactive_file", "file_dirty", "file_writeback"))
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "total_dirty", "total_writeback"))


def cgroup_limits(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> tuple[int, int] | None:
    """``(limit, left)``: the tightest memory limit of this process's cgroup and its ancestors
    (v2, else v1), and the bytes left under the limits, or None where none is set.

    A container or a SLURM job sets its limit on its own cgroup, not on the root: reading the
    root's files would find no limit and the job would be OOM-killed instead of offloading
    less. Inactive, clean page cache counts as free: the kernel reclaims it before any OOM kill.
    """
    v2, v1 = _own_cgroups(proc_cgroup)
    candidates = []
    if v2 is not None:
        candidates.append((root, v2, _V2))
    if v1 is not None:
        candidates.append((os.path.join(root, "memory"), v1, _V1))
    if not candidates:  # no /proc: the root's own files, as a last resort
        candidates = [(root, "/", _V2), (os.path.join(root, "memory"), "/", _V1)]
    for base, path, names in candidates:
        found = [x for d in _levels(base, path) if (x := _limit_and_left(d, names)) is not None]
        # Inside a namespace the cgroup path may be "/" while the files are those of our own group.
        if found:
            return min(f[0] for f in found), min(f[1] for f in found)
    return None


def cgroup_available(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes left under the tightest memory limit of this process's cgroups (see
    :func:`cgroup_limits`), or None where none is set."""
    limits = cgroup_limits(root, proc_cgroup)
    return None if limits is None else limits[1]


def _available_bytes() -> int:
    # In a container, the host's free RAM is not ours to take: the cgroup limit is.
    available = int(psutil.virtual_memory().available)
    cgroup = cgroup_available()
    return available if cgroup is None else min(available, cgroup)


def _total_bytes() -> int:
    """RAM this process may ever use: the machine's, or its cgroup limit when that is less (a
    128 GiB job on a 2 TiB node must keep a share of its 128 GiB free, not of the node's)."""
    total = int(psutil.virtual_memory().total)
    limits = cgroup_limits()
    return total if limits is None else min(total, limits[0])


class HostMemoryBudget:
    """Accounts host bytes held by offloadkit and refuses reservations past a limit.

    Two rules apply, both must hold for a reservation to succeed:

    * ``limit_bytes``: a hard cap on bytes held by everything sharing this budget
      (``None`` for no cap);
    * ``min_free_bytes``: the system must keep at least this much RAM available after
      the reservation. Checked against the live figure, so the guard adapts to other
      processes and to machines whose RAM grows as it is used. Defaults to the larger
      of 2 GiB and 10% of the RAM the process may use (the machine's, or its cgroup
      limit when that is less).

    Host RAM is a node's, not a process's: with ``ranks_per_node`` processes on a node (read
    from the launcher's ``LOCAL_WORLD_SIZE``), each takes at most its share of the RAM above
    ``min_free_bytes``, so eight ranks do not each plan on the whole free RAM. The share is
    taken when the budget is made, from the RAM free then (what the planner divides), and
    grows if more RAM is free later (machines whose RAM grows as it is used): a share read
    only live would shrink as the other ranks fill theirs, to 1/(2n-1) of the RAM for n
    ranks filling at once. ``limit_bytes`` is a cap per process.

    Args:
        limit_bytes: hard cap for this process, or None.
        min_free_bytes: RAM that must stay available, or None for the default.
        available_fn: where available RAM is read from (default: psutil within the cgroup limits).
        ranks_per_node: processes sharing this node's RAM (None: from the environment).

    Example:
        >>> budget = HostMemoryBudget(limit_bytes=8 << 30)
        >>> budget.try_reserve(1 << 30)
        True
        >>> budget.release(1 << 30)
    """

    REFRESH_S = 0.05

    def __init__(
        self,
        limit_bytes: int | None = None,
        min_free_bytes: int | None = None,
        available_fn: Callable[[], int] | None = None,
        ranks_per_node: int | None = None,
    ) -> None:
        for name, value in (("host_budget_bytes", limit_bytes), ("min_free_bytes", min_free_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(
                    f"{name}={value!r} is invalid; pass a byte count (int >= 0) or None "
                    "(strings such as '16GiB' are read by OffloadConfig / parse_bytes)"
                )
        self.limit_bytes = limit_bytes
        self.min_free_bytes = max(2 * _GiB, _total_bytes() // 10) if min_free_bytes is None else int(min_free_bytes)
        self._read_available = available_fn or _available_bytes
        self.ranks_per_node = local_world_size() if ranks_per_node is None else int(ranks_per_node)
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node!r} is invalid; pass an int >= 1")
        self._reading: tuple[float, int, int] | None = None  # (time, available, used then)
        self._used = 0
        self._share_at_start = self._live_share()
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

    def _available(self) -> int:
        """System RAM available now. Reading it costs a psutil call and cgroup file reads
        (~100 us), too much for every saved tensor: a reading is reused for
        :attr:`REFRESH_S`, minus what this budget reserved since."""
        now = time.monotonic()
        reading = self._reading
        if reading is None or now - reading[0] > self.REFRESH_S:
            reading = self._reading = (now, self._read_available(), self._used)
        return reading[1] - (self._used - reading[2])

    def _live_share(self) -> int | None:
        if self.ranks_per_node == 1:
            return None
        return max(0, self._available() + self._used - self.min_free_bytes) // self.ranks_per_node

    def node_share(self) -> int | None:
        """This process's share of the node's RAM above the guard (None: alone on the node)."""
        live = self._live_share()
        return None if live is None else max(live, self._share_at_start or 0)

    def _cap(self) -> int | None:
        caps = [c for c in (self.limit_bytes, self.node_share()) if c is not None]
        return min(caps) if caps else None

    def headroom(self) -> int:
        """Bytes that could be reserved right now."""
        by_free = self._available() - self.min_free_bytes
        cap = self._cap()
        if cap is None:
            return max(0, by_free)
        return max(0, min(by_free, cap - self._used))

    def try_reserve(self, nbytes: int, respect_cap: bool = True) -> bool:
        """Reserve ``nbytes``. ``respect_cap=False`` is for transient I/O buffers (disk
        staging, bounded by their own in-flight limit): only the free-RAM guard applies."""
        with self._lock:
            cap = self._cap()
            if respect_cap and cap is not None and self._used + nbytes > cap:
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
        cap = self._cap()
        cap_text = "none" if cap is None else f"{cap / _GiB:.2f} GiB"
        shared = f" (node RAM shared by {self.ranks_per_node} ranks)" if self.ranks_per_node > 1 else ""
        return (
            f"host budget: {self._used / _GiB:.2f} GiB held (peak {self._peak / _GiB:.2f}), "
            f"cap {cap_text}{shared}, keep {self.min_free_bytes / _GiB:.2f} GiB free"
        )
