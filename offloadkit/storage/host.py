"""RAM tier: device bytes <-> pooled (pinned) host buffers.

Stream discipline, CUDA sources with ``use_streams=True`` (the copies themselves are
queued by :func:`offloadkit.transfer.queue_copy` on the device's copy streams):

* store: the device->host stream waits for the compute stream (the source was produced
  there), copies, and records ``done``. The engine keeps the source alive until ``done``
  and makes the source's stream wait on it before the memory can be reused.
* load: the destination is allocated on the compute stream (so its reuse is ordered by
  that stream); the host->device stream waits for the compute stream (the block may have
  just been freed by compute work), copies and records ``ready``; consumers wait on
  ``ready``.

With ``use_streams=False`` ("legacy") every copy is queued on the live current stream:
no overlap, and stream order alone makes it safe. CPU sources are copied synchronously
into separate host buffers; that path exists so CPU-only runs exercise the engine.
"""

from __future__ import annotations

import torch

from offloadkit.defaults import PREFETCH_FROM_RAM
from offloadkit.runtime.device import current_stream
from offloadkit.storage.base import Loaded, Stored
from offloadkit.storage.pool import HostBufferPool
from offloadkit.transfer import copy_stream, queue_copy

__all__ = ["HostTier"]


class HostTier:
    """Offload to host RAM through a :class:`HostBufferPool`.

    Args:
        pool: where host buffers come from (pinned for CUDA overlap).
        use_streams: overlap copies with compute on a side stream per device.

    Example:
        >>> from offloadkit.storage import HostBufferPool, HostMemoryBudget, HostTier
        >>> tier = HostTier(HostBufferPool(False, HostMemoryBudget()), use_streams=False)
        >>> stored = tier.store(torch.arange(4096, dtype=torch.uint8))
        >>> tier.load(stored).data.sum() == torch.arange(4096, dtype=torch.uint8).sum()
        tensor(True)
    """

    name = "ram"
    default_prefetch = PREFETCH_FROM_RAM

    def __init__(self, pool: HostBufferPool, use_streams: bool = True) -> None:
        self.pool = pool
        self.pools = (pool,)
        self.use_streams = bool(use_streams)

    def store(self, src: torch.Tensor, where: str | None = None) -> Stored | None:
        nbytes = src.numel()
        block = self.pool.acquire(nbytes)
        if block is None:
            return None
        host = block.view(nbytes)
        stored = Stored(tier=self, nbytes=nbytes, device=src.device, payload=block)
        compute = current_stream(src.device)
        if compute is None:
            block.wait_host()  # a recycled block may still be in a device copy
            host.copy_(src)
            return stored
        stream = copy_stream(src.device, "d2h") if self.use_streams else compute
        # After compute: the source was produced by work queued there.
        stored.done = queue_copy(host, src, stream=stream, block=block, after=compute)
        stored.done_stream = stream
        return stored

    def load(self, stored: Stored) -> Loaded:
        block = stored.payload
        host = block.view(stored.nbytes)
        compute = current_stream(stored.device)
        # Allocated on the compute stream: its eventual reuse is ordered by that stream.
        dst = torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)
        if compute is None:
            dst.copy_(host)
            return Loaded(dst)
        stream = copy_stream(stored.device, "h2d") if self.use_streams else compute
        # After compute: dst may reuse memory whose last reader is queued there. The block
        # orders it after the device->host copy that filled it.
        ready = queue_copy(dst, host, stream=stream, block=block, after=compute)
        return Loaded(dst, ready=ready, alloc_stream=compute)  # consumers wait on ready

    def free(self, stored: Stored) -> None:
        block, stored.payload = stored.payload, None
        if block is not None:
            self.pool.release(block)  # the block carries its pending copies

    def host_bytes(self) -> int:
        return self.pool.bytes_held

    def host_bytes_in_use(self) -> int:
        return self.pool.bytes_in_use

    def bytes_on_disk(self) -> int:
        return 0

    def stats_dict(self) -> dict:
        return {}

    def reset_stats(self) -> None:
        pass

    def close(self) -> None:
        self.pool.close()
