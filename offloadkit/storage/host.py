"""RAM tier: device bytes <-> pooled (pinned) host buffers.

Stream discipline, CUDA sources with ``use_streams=True``:

* store: the side stream waits for the compute stream (the source was produced there),
  copies device->host, and records ``done``. The engine keeps the source alive until
  ``done`` and makes the source's stream wait on it before the memory can be reused.
* load: the destination is allocated on the compute stream (so its reuse is ordered by
  that stream); the side stream waits for the compute stream (the block may have just
  been freed by compute work), copies host->device and records ``ready``; consumers
  wait on ``ready``.

With ``use_streams=False`` ("legacy") every copy is queued on the live current stream:
no overlap, and stream order alone makes it safe. CPU sources are copied synchronously
into separate host buffers; that path exists so CPU-only runs exercise the engine.
"""

from __future__ import annotations

import torch

from offloadkit.runtime.copies import copy_on
from offloadkit.runtime.device import current_stream
from offloadkit.storage.base import Loaded, Stored
from offloadkit.storage.pool import HostBufferPool

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
    default_prefetch = 2

    def __init__(self, pool: HostBufferPool, use_streams: bool = True) -> None:
        self.pool = pool
        self.pools = (pool,)
        self.use_streams = bool(use_streams)
        self._side_streams: dict[int, torch.cuda.Stream] = {}

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._side_streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            self._side_streams[index] = stream
        return stream

    def store(self, src: torch.Tensor) -> Stored | None:
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
        stream = self.side_stream(src.device) if self.use_streams else compute
        if stream is not compute:
            stream.wait_stream(compute)  # the source was produced by work queued on compute
        block.order_device_use(stream)  # a recycled block may still be read by an earlier copy
        copy_on(stream, host, src, non_blocking=block.pinned)
        stored.done, stored.done_stream = stream.record_event(), stream
        block.note_use(stream, stored.done)
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
        stream = self.side_stream(stored.device) if self.use_streams else compute
        if stream is not compute:
            stream.wait_stream(compute)  # dst may reuse memory whose last reader is queued on compute
        # The bytes must have landed: the device->host copy may be on another stream.
        block.order_device_use(stream)
        copy_on(stream, dst, host, non_blocking=block.pinned)
        ready = stream.record_event()  # consumers on other streams wait on this
        block.note_use(stream, ready)
        return Loaded(dst, ready=ready, alloc_stream=compute)

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
