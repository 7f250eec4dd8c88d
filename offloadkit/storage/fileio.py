"""Low-level file I/O for the disk tier: aligned lengths, buffer views of host memory
without numpy, and pread/pwrite loops that retry short transfers and never ignore one.
``os.pwrite``/``os.preadv`` release the GIL, so a few threads keep the device busy."""

from __future__ import annotations

import ctypes
import errno
import functools
import os

import torch

from offloadkit.runtime.device import PAGE_SIZE
from offloadkit.storage.pool import HostBlock

__all__ = ["Busy", "align", "allocated_bytes", "view", "temporary_block", "punch_hole", "pwrite_all", "pread_all"]


class Busy:
    """Union of intervals during which at least one job of a kind ran."""

    def __init__(self) -> None:
        self.active = 0
        self.since = 0.0

    def start(self, now: float) -> None:
        if self.active == 0:
            self.since = now
        self.active += 1

    def stop(self, now: float) -> float:
        self.active -= 1
        return now - self.since if self.active == 0 else 0.0


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


@functools.lru_cache(maxsize=1)
def _fallocate():
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):  # not Linux/glibc
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give the blocks of ``[offset, offset + length)`` back to the file system (the file
    keeps its size). False where the file system or platform cannot."""
    fn = _fallocate()
    if fn is None:
        return False
    return fn(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0


def allocated_bytes(fd: int) -> int:
    """Bytes the file system holds for ``fd`` (holes excluded)."""
    return os.fstat(fd).st_blocks * 512


def align(n: int) -> int:
    return -(-n // PAGE_SIZE) * PAGE_SIZE


def view(block: HostBlock, length: int) -> memoryview:
    # A buffer-protocol view of pinned/page-aligned host memory, without numpy.
    return memoryview((ctypes.c_ubyte * length).from_address(block.buffer.data_ptr())).cast("B")


def temporary_block(nbytes: int) -> HostBlock:
    raw = torch.empty(nbytes + PAGE_SIZE, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % PAGE_SIZE
    return HostBlock(raw[offset : offset + nbytes], nbytes, pinned=False)


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.pwrite(fd, buf[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short write at offset {offset + done}")
        done += n


def pread_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read at offset {offset + done}: file ended")
        done += n
