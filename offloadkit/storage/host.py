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

    def __init__(self, pool: HostBufferPool, use_streams: bool = True) -> None:
        self.pool = pool
        self.use_streams = bool(use_streams)
        self._side_streams: dict[int, torch.cuda.Stream] = {}
        # Race tests: a device-side sleep queued before every side-stream copy makes any
        # missing wait show up as wrong numbers instead of passing by luck.
        self.debug_delay_cycles = 0

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
            if block.last_use is not None:
                block.last_use[1].synchronize()  # a recycled buffer may still be in a device copy
            host.copy_(src)
            return stored
        if self.use_streams:
            side = self.side_stream(src.device)
            # The source was produced by work already queued on the compute stream.
            side.wait_stream(compute)
            self._after_last_use(side, block)
            with torch.cuda.stream(side):
                self._debug_delay()
                host.copy_(src, non_blocking=block.pinned)
            stored.done, stored.done_stream = side.record_event(), side
        else:
            self._after_last_use(compute, block)
            host.copy_(src, non_blocking=block.pinned)
            stored.done, stored.done_stream = compute.record_event(), compute
        stored.last_use = (stored.done_stream, stored.done)
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
        if self.use_streams:
            side = self.side_stream(stored.device)
            # dst may reuse memory whose last reader is compute work queued before now.
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                self._debug_delay()
                dst.copy_(host, non_blocking=block.pinned)
            ready = side.record_event()
            stored.last_use = (side, ready)
            return Loaded(dst, ready=ready, alloc_stream=compute)
        if stored.done_stream is not None and stored.done_stream != compute:
            compute.wait_event(stored.done)  # stored on another stream: order after that copy
        dst.copy_(host, non_blocking=block.pinned)
        ready = compute.record_event()  # consumers on other streams wait on this
        stored.last_use = (compute, ready)
        return Loaded(dst, ready=ready, alloc_stream=compute)

    def free(self, stored: Stored) -> None:
        block, stored.payload = stored.payload, None
        if block is not None:
            self.pool.release(block, stored.last_use)

    def close(self) -> None:
        self.pool.close()

    def _debug_delay(self) -> None:
        if self.debug_delay_cycles:
            torch.cuda._sleep(self.debug_delay_cycles)

    @staticmethod
    def _after_last_use(stream: torch.cuda.Stream, block) -> None:
        # A recycled host buffer may still be read by an earlier copy on another stream.
        if block.last_use is not None and block.last_use[0] != stream:
            stream.wait_event(block.last_use[1])
