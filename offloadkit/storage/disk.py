"""Disk tier: device bytes -> pooled staging buffer -> file, and back ahead of need.

I/O is shaped for the device, not for Python: each step's entries are appended to one
segment file with 4 KiB-aligned lengths and offsets (``O_DIRECT`` where the filesystem
takes it, so the page cache does not eat the RAM the tier exists to save), written and
read by small thread pools whose ``os.pwrite``/``os.preadv`` calls release the GIL.
Staging buffers come from a page-aligned pool accounted against the host budget; bytes
in flight are bounded. Segment files are unlinked as soon as they are opened (they live
on through their descriptors, and their space returns when the process ends however it
ends); a freed entry's extent is punched out of its file, so the space on disk follows
what is alive even while an old graph keeps a few entries of a segment.

Ordering: a write job waits for the device->host copy's event before touching the
staging buffer; a read job waits for the entry's write and for every device copy still
using its staging buffer (a recycled buffer may be the source of a host->device copy
queued behind busy compute), reads, then queues the host->device copy on the side stream
(after the compute stream reached the point where the destination was allocated) and
returns that copy's event; consumers wait for the job on the host and for the event on
their stream. After ``close()`` a graph that is still alive is read back synchronously.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from offloadkit.defaults import PREFETCH_FROM_DISK
from offloadkit.options import Options, option
from offloadkit.runtime.device import current_stream
from offloadkit.storage.base import Loaded, Stored
from offloadkit.storage.budget import HostMemoryBudget
from offloadkit.storage.cleanup import create_private_dir, remove_dir
from offloadkit.storage.fileio import (
    Busy,
    align,
    allocated_bytes,
    pread_all,
    punch_hole,
    pwrite_all,
    temporary_block,
    view,
)
from offloadkit.storage.pool import HostBlock, HostBufferPool
from offloadkit.transfer import copy_stream, queue_copy
from offloadkit.transfer.completion import FutureCompletion

__all__ = ["DiskOptions", "DiskTier", "DiskFullError", "DiskStats", "MAX_INFLIGHT_BYTES"]

# Writes queued but not finished, at most, by default: the host RAM their staging buffers take
# outside the RAM cap (the planner counts them).
MAX_INFLIGHT_BYTES = 1 << 30


class DiskFullError(OSError):
    """The disk tier has no room and host RAM cannot take the bytes either."""


@dataclass
class DiskOptions(Options):
    """Settings of the disk tier.

    Args:
        directory: ``disk_dir``: parent of the private spill directory (default: the system
            temp dir).
        threads: ``disk_threads``: I/O threads for writes and, separately, for reads (>= 1).
        direct_io: ``direct_io``: True, False or "auto" (O_DIRECT where the filesystem
            supports it).
        max_inflight_bytes: writes queued but not finished, at most (backpressure).
        segment_bytes: a segment file is closed to new entries past this size, so that
            space returns even where the file system cannot punch holes.
    """

    directory: str | None = option(None, "disk_dir")
    threads: int = option(4, "disk_threads")
    direct_io: bool | str = option("auto", "direct_io")
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES
    segment_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.directory is not None and not isinstance(self.directory, (str, os.PathLike)):
            raise ValueError(f"{self.named('directory')}={self.directory!r} is invalid; pass a path (str) or None")
        if self.directory is not None:
            self.directory = os.fspath(self.directory)
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1:
            raise ValueError(f"{self.named('threads')}={self.threads!r} is invalid; pass an int >= 1")
        if self.direct_io not in (True, False, "auto"):
            raise ValueError(f"{self.named('direct_io')}={self.direct_io!r} is invalid; use true, false or auto")
        for name in ("max_inflight_bytes", "segment_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} is invalid; pass a byte count >= 0")


@dataclass
class DiskStats:
    bytes_written: int = 0
    bytes_read: int = 0
    write_busy_s: float = 0.0  # wall time with at least one write in progress
    read_busy_s: float = 0.0
    segments: int = 0
    holes_punched: int = 0
    fallbacks: int = 0  # entries kept in RAM because the disk refused them
    direct_io: bool | None = None

    @property
    def write_gb_s(self) -> float:
        return self.bytes_written / self.write_busy_s / 1e9 if self.write_busy_s else 0.0

    @property
    def read_gb_s(self) -> float:
        return self.bytes_read / self.read_busy_s / 1e9 if self.read_busy_s else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(write_gb_s=self.write_gb_s, read_gb_s=self.read_gb_s)
        return d


@dataclass(eq=False)
class _Segment:
    path: str
    fd: int
    direct: bool
    size: int = 0
    live: int = 0  # entries stored in it and not freed
    pending: int = 0  # I/O jobs that still use the descriptor
    sealed: bool = False  # takes no new entries; closed once nothing lives in it or uses it


@dataclass(eq=False)
class _Record:
    segment: _Segment
    offset: int
    length: int  # aligned
    write: Any = None  # Future of the write job
    copied: Any = None  # event: the device->host copy into the staging buffer
    fallback: HostBlock | None = None  # bytes kept in RAM when the disk refused them
    pool: Any = None  # where ``fallback`` goes back to (None: this tier's staging pool)
    freed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class DiskTier:
    """Offload to files in a private directory, staged through pooled host buffers.

    Args:
        budget: host-memory budget the staging buffers are accounted against.
        options: :class:`DiskOptions`.
        pin_memory: page-lock staging buffers (for asynchronous device copies).
        use_streams: device copies on a side stream (False: on the current stream).

    Example:
        >>> tier = DiskTier(HostMemoryBudget(), DiskOptions(directory="/scratch"))
        >>> stored = tier.store(torch.arange(8192, dtype=torch.uint8))
        >>> loaded = tier.load(stored); loaded.ready.synchronize()
        >>> tier.close()
    """

    name = "disk"
    default_prefetch = PREFETCH_FROM_DISK  # reads take longer than pinned copies

    def __init__(
        self,
        budget: HostMemoryBudget,
        options: DiskOptions | None = None,
        pin_memory: bool = True,
        use_streams: bool = True,
    ) -> None:
        if options is not None and not isinstance(options, DiskOptions):
            raise ValueError(f"disk={options!r} is invalid; pass DiskOptions(directory=...) or None")
        self.options = options or DiskOptions()
        self.directory = create_private_dir(self.options.directory)
        # Staging is transient and bounded by max_inflight_bytes: the RAM cap (meant for
        # bytes kept in RAM) must not starve it; the free-RAM guard still applies.
        self.pool = HostBufferPool(pin_memory and torch.cuda.is_available(), budget, respect_cap=False)
        self.pools = (self.pool,)
        self.use_streams = use_streams
        self.stats = DiskStats()
        self._writer: ThreadPoolExecutor | None = ThreadPoolExecutor(
            self.options.threads, thread_name_prefix="offloadkit-disk-write"
        )
        self._reader: ThreadPoolExecutor | None = ThreadPoolExecutor(
            self.options.threads, thread_name_prefix="offloadkit-disk-read"
        )
        self._lock = threading.Condition()
        self._segment: _Segment | None = None
        self._segments: set[_Segment] = set()  # open descriptors
        self._segment_count = 0
        self._direct: bool | None = None if self.options.direct_io == "auto" else bool(self.options.direct_io)
        self._can_punch = True
        self._inflight = 0
        self._pending_write_bytes = 0
        self.disk_in_use = 0  # bytes of extents allocated and not freed
        self._write_busy = Busy()
        self._read_busy = Busy()
        self._fallback_warned = False
        self._closed = False

    # -- StorageTier ---------------------------------------------------------------------
    def store(self, src: torch.Tensor, where: str | None = None) -> Stored | None:
        if self._closed:
            raise RuntimeError("offloadkit: the disk tier was closed; create a new manager")
        nbytes = src.numel()
        length = align(max(nbytes, 1))
        block = self._acquire_staging(nbytes)
        if block is None:
            free = shutil.disk_usage(self.directory).free
            if free < length:
                raise self._full_error(free, length)
            return None  # no staging memory at all: the engine keeps the tensor on the device
        segment, offset = self._allocate(length)
        if segment is None:
            budget = self.pool.budget
            if budget.limit_bytes is not None and budget.used_bytes > budget.limit_bytes:
                self.pool.release(block)  # keeping it in RAM would break the RAM cap
                raise self._full_error(shutil.disk_usage(self.directory).free, length)
            self.stats.fallbacks += 1
            self._warn_fallback(
                f"{shutil.disk_usage(self.directory).free} bytes free in {self.directory}, {length} needed"
            )
        try:
            return self._stage(src, nbytes, length, block, segment, offset)
        except BaseException:
            if segment is not None:
                self._unallocate(segment, length)  # nothing will write it: keep the counters true
            self.pool.release(block)
            raise

    def _stage(self, src, nbytes, length, block, segment, offset) -> Stored:
        stored = Stored(tier=self, nbytes=nbytes, device=src.device)
        compute = current_stream(src.device)
        if compute is None:
            block.wait_host()  # a recycled buffer may still be in a device copy
            block.view(nbytes).copy_(src)
            copied = None
        else:
            stream = copy_stream(src.device, "d2h") if self.use_streams else compute
            # After compute: the source was produced there.
            copied = queue_copy(block.view(nbytes), src, stream=stream, block=block, after=compute)
            stored.done, stored.done_stream = copied, stream
        record = _Record(segment, offset, length, copied=copied)
        stored.payload = record
        if segment is None:  # no room on disk: the staging buffer is the copy
            record.fallback = block
            return stored
        record.write = self._submit_write(record, block, copied)
        return stored

    def adopt(
        self, block: HostBlock, nbytes: int, device: torch.device, copied, pool: HostBufferPool, on_done
    ) -> Stored | None:
        """Write bytes that already sit in a host block of another tier (``pool``).

        ``on_done(ok)`` runs when the write finished (``ok``) or failed; either way the block
        still belongs to the caller. Returns None when the disk has no room.
        """
        with self._lock:
            writer = self._writer
        if writer is None:
            return None  # closed: the bytes stay where they are
        length = align(max(nbytes, 1))
        segment, offset = self._allocate(length)
        if segment is None:
            return None
        record = _Record(segment, offset, length, copied=copied, pool=pool)
        try:
            # Always on the pool: ``on_done`` must not run before the caller has recorded the demotion.
            record.write = writer.submit(self._write_job, record, block, copied, on_done)
        except RuntimeError:  # closed meanwhile
            self._unallocate(segment, length)
            return None
        return Stored(tier=self, nbytes=nbytes, device=device, payload=record)

    def load(self, stored: Stored) -> Loaded:
        record: _Record = stored.payload
        compute = current_stream(stored.device)
        dst = torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)  # on the compute stream
        allocated = compute.record_event() if compute is not None else None
        stream = None
        if compute is not None:
            stream = copy_stream(stored.device, "h2d") if self.use_streams else compute
        if record.segment is not None:
            with self._lock:
                record.segment.pending += 1
        with self._lock:
            reader = self._reader
        if reader is None:
            # Closed while a graph is still alive: read it back on this thread.
            future: Future = Future()
            try:
                future.set_result(self._read_job(record, stored.nbytes, dst, allocated, stream))
            except BaseException as exc:
                future.set_exception(exc)
        else:
            future = reader.submit(self._read_job, record, stored.nbytes, dst, allocated, stream)
        return Loaded(dst, ready=FutureCompletion(future), alloc_stream=compute)

    def free(self, stored: Stored, wait: bool = True) -> None:
        """Give the entry's space back; with ``wait``, after its write finished."""
        record: _Record = stored.payload
        if record.write is not None and not record.write.done():
            if wait:
                record.write.exception()  # wait; a failed write was already handled
            else:
                record.write.add_done_callback(lambda _: self._release(record))
                return
        self._release(record)

    def host_bytes(self) -> int:
        return self.pool.bytes_held

    def host_bytes_in_use(self) -> int:
        return self.pool.bytes_in_use

    def bytes_on_disk(self) -> int:
        return self.disk_in_use

    def disk_bytes(self) -> int:
        """Bytes the file system really holds for this tier's files."""
        with self._lock:
            return sum(allocated_bytes(s.fd) for s in self._segments if s.fd >= 0)

    def reset_stats(self) -> None:
        # Counters only: segments and the I/O mode describe the files, not a period.
        old = self.stats
        self.stats = DiskStats(segments=old.segments, direct_io=old.direct_io)

    def stats_dict(self) -> dict:
        d = self.stats.as_dict()
        d.update(bytes_on_disk=self.disk_in_use, disk_bytes=self.disk_bytes())
        return {"disk": d}

    def close(self) -> None:
        """Finish queued I/O and remove the directory. Entries of graphs still alive stay
        readable (their descriptors stay open) until they are freed."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            writer, reader = self._writer, self._reader
            self._writer = self._reader = None
        for pool in (writer, reader):
            if pool is not None:
                pool.shutdown(wait=True)
        with self._lock:
            if self._segment is not None:
                self._seal(self._segment)
        remove_dir(self.directory)
        self.pool.close()

    # -- staging and space ---------------------------------------------------------------
    def _acquire_staging(self, nbytes: int) -> HostBlock | None:
        with self._lock:
            # Backpressure: at most max_inflight_bytes queued for writing.
            while self._inflight and self._inflight + nbytes > self.options.max_inflight_bytes:
                self._lock.wait()
        block = self.pool.acquire(nbytes)
        while block is None:
            with self._lock:
                if not self._inflight:
                    break
                self._lock.wait()  # staging buffers come back as writes finish
            block = self.pool.acquire(nbytes)
        return block

    def _allocate(self, length: int) -> tuple[_Segment | None, int]:
        with self._lock:
            free = shutil.disk_usage(self.directory).free - self._pending_write_bytes
            if free < length:
                return None, 0
            segment = self._segment
            if segment is not None and segment.size + length > max(self.options.segment_bytes, length) and segment.size:
                self._seal(segment)
                segment = None
            if segment is None:
                segment = self._segment = self._open_segment()
            offset = segment.size
            segment.size += length
            segment.live += 1
            segment.pending += 1
            self.disk_in_use += length
            self._inflight += length
            self._pending_write_bytes += length
            return segment, offset

    def _unallocate(self, segment: _Segment, length: int) -> None:
        with self._lock:
            segment.live -= 1
            segment.pending -= 1
            self.disk_in_use -= length
            self._inflight -= length
            self._pending_write_bytes -= length
            if segment.live == 0:
                self._seal(segment)
            self._lock.notify_all()

    def _open_segment(self) -> _Segment:
        path = os.path.join(self.directory, f"segment-{self._segment_count}.bin")
        self._segment_count += 1
        self.stats.segments += 1
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        direct_flag = getattr(os, "O_DIRECT", 0)
        fd = -1
        if self._direct is not False and direct_flag:
            try:
                fd = os.open(path, flags | direct_flag, 0o600)
                self._direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL or self.options.direct_io is True:
                    raise OSError(
                        exc.errno,
                        f"offloadkit: cannot open {path} with O_DIRECT: {exc.strerror}"
                        + ("; set direct_io to auto or false" if exc.errno == errno.EINVAL else ""),
                    ) from exc
                self._direct = False  # e.g. tmpfs: fall back to buffered I/O
        if fd < 0:
            fd = os.open(path, flags, 0o600)
        self.stats.direct_io = bool(self._direct)
        os.unlink(path)  # lives on through fd; its space returns when the process ends
        segment = _Segment(path, fd, bool(self._direct))
        self._segments.add(segment)
        return segment

    def _full_error(self, free: int, length: int) -> DiskFullError:
        return DiskFullError(
            errno.ENOSPC,
            f"offloadkit: the disk tier directory {self.directory} has {free} bytes free and {length} are "
            f"needed, and the host-memory budget refuses to keep them in RAM ({self.pool.budget.describe()}); "
            "free disk space, point the disk directory elsewhere or raise the host budget",
        )

    def _warn_fallback(self, why: str) -> None:
        if not self._fallback_warned:
            self._fallback_warned = True
            warnings.warn(
                f"offloadkit: the disk tier refused data ({why}); keeping it in host RAM instead",
                RuntimeWarning,
                stacklevel=4,
            )

    # -- jobs ------------------------------------------------------------------------------
    def _submit_write(self, record: _Record, block: HostBlock, copied, on_done=None) -> Future:
        with self._lock:
            writer = self._writer
        if writer is not None:
            return writer.submit(self._write_job, record, block, copied, on_done)
        future: Future = Future()  # closed: write on this thread
        self._write_job(record, block, copied, on_done)
        future.set_result(None)
        return future

    def _write_job(self, record: _Record, block: HostBlock, copied, on_done=None) -> None:
        segment = record.segment
        if copied is not None:
            copied.synchronize()  # the device->host copy into the staging buffer has landed
        with self._lock:
            self._write_busy.start(time.perf_counter())
        try:
            pwrite_all(segment.fd, view(block, record.length), record.offset)
        except OSError as exc:
            with self._lock:
                self.stats.fallbacks += 1
            self._warn_fallback(f"writing {segment.path} failed: {exc.strerror or exc}")
            if on_done is not None:
                on_done(False)  # adopted bytes: their owner keeps them
            else:
                record.fallback = block  # still in the staging buffer: keep them there, not lose them
        else:
            if on_done is not None:
                on_done(True)
            else:
                self.pool.release(block)
            with self._lock:
                self.stats.bytes_written += record.length
        finally:
            with self._lock:
                self.stats.write_busy_s += self._write_busy.stop(time.perf_counter())
                self._inflight -= record.length
                self._pending_write_bytes -= record.length
                segment.pending -= 1
                self._maybe_close(segment)
                self._lock.notify_all()

    def _read_job(self, record: _Record, nbytes: int, dst: torch.Tensor, allocated, stream):
        segment = record.segment
        try:
            if record.write is not None:
                record.write.result()  # the bytes must be on disk (or kept in RAM) first
            staging, pooled = record.fallback, False
            if staging is None:
                staging = None if self._closed else self.pool.acquire(record.length)
                pooled = staging is not None
                if staging is None:  # over budget: a short-lived buffer outside the pool
                    staging = temporary_block(record.length)
            try:
                if staging is not record.fallback:
                    # A recycled buffer may still be the source of a host->device copy queued
                    # behind busy compute: the read must not overwrite it before that copy ran.
                    staging.wait_host()
                    with self._lock:
                        self._read_busy.start(time.perf_counter())
                    try:
                        pread_all(segment.fd, view(staging, record.length), record.offset)
                    finally:
                        with self._lock:
                            self.stats.read_busy_s += self._read_busy.stop(time.perf_counter())
                            self.stats.bytes_read += record.length
                if stream is None:
                    staging.wait_host()
                    dst.copy_(staging.view(nbytes))
                    return None
                # After the allocation point: dst may reuse memory compute released before it.
                # The block orders it after the device->host copy of RAM-kept bytes.
                return queue_copy(dst, staging.view(nbytes), stream=stream, block=staging, after=allocated)
            finally:
                if pooled:
                    self.pool.release(staging)  # also when the read failed: never leak the buffer
        finally:
            if segment is not None:
                with self._lock:
                    segment.pending -= 1
                    self._maybe_close(segment)

    # -- lifetime ----------------------------------------------------------------------------
    def _release(self, record: _Record) -> None:
        with record.lock:
            if record.freed:
                return
            record.freed = True
        if record.fallback is not None:
            (record.pool or self.pool).release(record.fallback)
            record.fallback = None
        segment = record.segment
        if segment is None:
            return
        with self._lock:
            segment.live -= 1
            self.disk_in_use -= record.length
            if segment.fd >= 0 and segment.live > 0 and self._can_punch:
                # Other entries keep this file: give this extent's blocks back now.
                if punch_hole(segment.fd, record.offset, record.length):
                    self.stats.holes_punched += 1
                else:
                    self._can_punch = False
            if segment.live == 0:
                self._seal(segment)

    def _seal(self, segment: _Segment) -> None:
        segment.sealed = True
        if self._segment is segment:
            self._segment = None
        self._maybe_close(segment)

    def _maybe_close(self, segment: _Segment) -> None:
        if segment.sealed and segment.live == 0 and segment.pending == 0 and segment.fd >= 0:
            os.close(segment.fd)
            segment.fd = -1
            self._segments.discard(segment)

    def describe(self) -> str:
        s = self.stats
        return (
            f"disk tier {self.directory}: {s.bytes_written / 2**30:.2f} GiB written at {s.write_gb_s:.2f} GB/s, "
            f"{s.bytes_read / 2**30:.2f} GiB read at {s.read_gb_s:.2f} GB/s, O_DIRECT={s.direct_io}, "
            f"{s.fallbacks} kept in RAM"
        )
