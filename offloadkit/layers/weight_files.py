"""Streamed weights past the RAM budget: a block's host copy kept in a file.

When the host-memory budget refuses a block's pinned copy and a directory is given
(``layer_offloading_dir``), the copy lives in a file of its own, memory-mapped: the kernel's
page cache holds what RAM can spare and the disk the rest. A load reads the file into a
pinned staging buffer on an I/O thread, then queues the host->device copy from it on the
process's copy stream (:func:`~offloadkit.transfer.queue_copy`); the consumer waits on the
returned completion as for a pinned load, and the look-ahead (the run's prefetch scheduler)
starts these reads ``depth - 1`` blocks early, as for pinned blocks.

Trainable weights (a full fine-tune) go to files too, when their optimizer updates them in
backward while the block is resident (``BackwardAdamW``/``BackwardSGD`` without clipping): the
eviction queues the updated bytes into pinned staging on the device->host stream, and an I/O
thread writes them into the file; the next read of that file waits for the write. An update
deferred to ``step()`` (clipping, fp16 loss scaling) would write an evicted weight through the
GPU's mapping of pinned memory, which a file does not have: the optimizer refuses it with the
fix. Every job on a file waits for the one queued before it on the same file.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from offloadkit.storage.budget import HostMemoryBudget
from offloadkit.storage.cleanup import create_private_dir, remove_dir
from offloadkit.storage.fileio import temporary_block
from offloadkit.storage.pool import HostBufferPool
from offloadkit.transfer import queue_copy
from offloadkit.transfer.completion import FutureCompletion

__all__ = ["FileBlock", "WeightFiles"]


class FileBlock:
    """One block's host copy in a memory-mapped file; stands where a pinned
    :class:`~offloadkit.storage.pool.HostBlock` would (``view``, ``wait_host``...)."""

    pinned = False

    def __init__(self, path: str, nbytes: int) -> None:
        self.path = path
        self.capacity = nbytes
        self.buffer = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        self.pending: Future | None = None  # the last read or write of the file queued
        self.write_error: BaseException | None = None  # a failed write: the file is stale

    def view(self, nbytes: int) -> torch.Tensor:
        return self.buffer[:nbytes]

    def wait_host(self) -> None:
        """Block until no I/O thread reads or writes the file (each job waits for the one
        before it, so the last queued is the last to finish)."""
        pending = self.pending
        if pending is not None:
            pending.exception()  # waits; a failure was raised to its consumer

    def order_device_use(self, stream) -> None:
        self.wait_host()  # device copies never touch the file itself, only staging buffers

    def note_use(self, stream, event) -> None:
        pass

    def release(self) -> None:
        """Drop the mapping and the file (every alias of it is gone)."""
        self.wait_host()
        self.buffer = torch.empty(0, dtype=torch.uint8)
        try:
            os.unlink(self.path)
        except OSError:
            pass


class WeightFiles:
    """The files of one streamer's blocks past the RAM budget, and the I/O threads that read
    them into pinned staging buffers.

    Args:
        parent: where the private directory of the files is created.
        budget: the host-memory budget staging buffers are accounted against (transient, so
            outside the RAM cap; the free-RAM guard applies).
        pin_memory: page-lock the staging buffers (asynchronous device copies).
        threads: I/O threads reading the files.
    """

    def __init__(self, parent: str | None, budget: HostMemoryBudget, pin_memory: bool, threads: int = 2) -> None:
        self.directory = create_private_dir(parent)
        self.staging = HostBufferPool(pin_memory and torch.cuda.is_available(), budget, respect_cap=False)
        self._io = ThreadPoolExecutor(threads, thread_name_prefix="offloadkit-weights-read")
        self._lock = threading.Lock()
        self.blocks = 0
        self.bytes_on_disk = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self._closed = False

    def block(self, name: str, nbytes: int) -> FileBlock:
        """A new file for ``nbytes`` of block ``name``'s weights."""
        with self._lock:
            self.blocks += 1
            self.bytes_on_disk += nbytes
            index = self.blocks
        safe = "".join(c if c.isalnum() else "_" for c in name)[-80:]
        return FileBlock(os.path.join(self.directory, f"{index:05d}-{safe}.bin"), nbytes)

    def load(self, block: FileBlock, dst: torch.Tensor, allocated, stream) -> FutureCompletion:
        """Read ``block`` into device ``dst`` on an I/O thread: file -> pinned staging ->
        ``dst`` on ``stream``, after ``allocated`` (the event where ``dst`` was allocated on the
        compute stream: its memory may have been released by work queued before it).

        Returns:
            The completion to wait on (its result is the copy's device event).
        """
        future = self._io.submit(self._read, block, dst, allocated, stream, block.pending)
        block.pending = future
        return FutureCompletion(future)

    def store(self, block: FileBlock, src: torch.Tensor, compute, d2h) -> FutureCompletion:
        """Write device ``src`` into ``block``'s file: into pinned staging on ``d2h`` after the
        work queued on ``compute`` (the update that changed it), then into the file on an I/O
        thread. The caller keeps ``src``'s memory from reuse until the copy read it
        (``record_stream``).

        Returns:
            The completion of the write (no device part left).
        """
        nbytes = src.numel()
        staging, pooled = self._staging(nbytes)
        copied = queue_copy(staging.view(nbytes), src, stream=d2h, block=staging, after=compute)
        future = self._io.submit(self._write, block, staging, pooled, copied, block.pending)
        block.pending = future
        return FutureCompletion(future)

    def _write(self, block: FileBlock, staging, pooled: bool, copied, before: Future | None) -> None:
        try:
            if before is not None:
                before.exception()  # an earlier read of the file finishes first
            copied.synchronize()  # the device->host copy into staging has landed
            nbytes = block.capacity
            block.view(nbytes).copy_(staging.view(nbytes))
            with self._lock:
                self.bytes_written += nbytes
        except BaseException as exc:
            block.write_error = exc  # every later read of this file must fail, not load stale weights
            raise
        finally:
            if pooled:
                self.staging.release(staging)

    def _read(self, block: FileBlock, dst: torch.Tensor, allocated, stream, before: Future | None):
        if before is not None:
            before.exception()  # the last write of the file lands first
        if block.write_error is not None:
            raise RuntimeError(
                f"offloadkit: writing the updated weights to {block.path} failed ({block.write_error!r}); "
                "the file holds stale weights"
            )
        nbytes = dst.numel()
        staging, pooled = self._staging(nbytes)
        try:
            # A recycled buffer may still feed an earlier host->device copy.
            staging.wait_host()
            staging.view(nbytes).copy_(block.view(nbytes))  # the page cache, or the disk
            with self._lock:
                self.bytes_read += nbytes
            return queue_copy(dst, staging.view(nbytes), stream=stream, block=staging, after=allocated)
        finally:
            if pooled:
                self.staging.release(staging)  # its next user waits for the copy (note_use)

    def _staging(self, nbytes: int):
        """A pinned staging buffer from the pool and True, or, where the free-RAM guard refuses
        one, a short-lived pageable buffer (its device copy is synchronous) and False."""
        staging = self.staging.acquire(nbytes)
        if staging is not None:
            return staging, True
        return temporary_block(nbytes), False

    def close(self) -> None:
        """Stop the I/O threads and remove the directory (after every block was released)."""
        if self._closed:
            return
        self._closed = True
        self._io.shutdown(wait=True)
        self.staging.close()
        remove_dir(self.directory)
