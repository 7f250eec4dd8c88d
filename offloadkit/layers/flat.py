"""One block's weights as a single flat device storage backed by a pinned host copy.

While the block is resident each streamed parameter is a view into the block's flat
device storage (at a 512-byte aligned offset, so kernels see the same alignment as before
and results stay bitwise equal). Loading resizes the storage to its full size and copies
the bytes in; evicting resizes it to zero. The views autograd saved of the parameters
(``weight.t()``) keep pointing at that storage object, so they are valid whenever the
block is resident again in backward.

While the block is evicted the parameters themselves point at the pinned host copy, seen
from the GPU at the same address (zero-copy; a CPU tensor where the GPU cannot address
it): reading a weight, ``state_dict()``, ``load_state_dict()``, PEFT's merge or saving see
and change the real values instead of a zero-byte storage, and ``model.to("cuda")`` (as
the Trainer does) moves nothing. The host copy is made once; a resident block's in-place
changes reach it through :meth:`FlatWeights.write_back`.

Trainable weights stream the same way. Whatever changed a resident weight in place (an
optimizer updating it during backward) moves its version counter; eviction then queues the
block's bytes back into the host copy on the device->host stream before the device memory is
released, and the next load of the block is ordered after that copy. A kernel that writes a
weight without moving the counter (PyTorch's fused optimizer kernels) must be followed by
``torch.autograd.graph.increment_version``, as offloadkit's optimizers do; otherwise its change
stays on the GPU and is lost at eviction.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from offloadkit.layers.weight_files import FileBlock, WeightFiles
from offloadkit.runtime.autograd import in_backward, version_of
from offloadkit.runtime.device import device_alias_of_host, host_alias
from offloadkit.storage.pool import HostBlock, HostBufferPool
from offloadkit.transfer import copy_stream, queue_copy
from offloadkit.transfer.completion import FutureCompletion, order_after

__all__ = ["FlatWeights", "STREAMED_STORAGE", "order_after_write_back", "streamable_reason"]

STREAMED_STORAGE = "_offloadkit_streamed_storage"  # parameter attribute: its flat device storage
_STREAMED_BY = "_offloadkit_streamed_by"  # parameter attribute: its FlatWeights (a weak reference)


def order_after_write_back(param: torch.Tensor) -> None:
    """Make the current stream wait for a write-back still copying ``param``'s block to its
    host copy, before the caller writes ``param`` where it rests (through the GPU's mapping of
    the host copy, while evicted): otherwise the late write-back could overwrite the change."""
    ref = param.__dict__.get(_STREAMED_BY)
    layer = ref() if ref is not None else None
    if layer is None or layer.resident or layer.written is None:
        return
    if torch.cuda.is_available() and layer.device.type == "cuda":
        order_after(torch.cuda.current_stream(layer.device), layer.written)


_ALIGN = 512
_RAW_DATA_PARAMS = {"Params4bit", "Int8Params"}  # bitsandbytes: quantized bytes live in .data


def streamable_reason(param: nn.Parameter, shared: bool, trainable: bool = False) -> str | None:
    """Why ``param`` cannot be streamed, or None (``trainable``: trainable weights may be)."""
    if param.requires_grad and not trainable:
        return "trainable"
    if shared:
        return "shared"
    data = param.data
    if type(data) is not torch.Tensor:
        return "tensor subclass"  # e.g. torchao quantized tensors: their bytes live in inner tensors
    if type(param) is not nn.Parameter and type(param).__name__ not in _RAW_DATA_PARAMS:
        return "parameter subclass"
    if not data.is_contiguous() or data.layout is not torch.strided:
        return "not contiguous"
    if data.device.type == "meta":
        return "meta"
    return None


@dataclass
class _Slot:
    name: str  # qualified name relative to the block
    param: nn.Parameter
    offset: int  # bytes into the flat storage
    nbytes: int


class _Lease:
    """Owns one block's host copy on behalf of its :class:`FlatWeights` and of every alias of
    it: when the last of them is gone, the block goes back to its pool."""

    __slots__ = ("__weakref__",)


def _lease(pool: HostBufferPool, block, device: torch.device) -> _Lease:
    lease = _Lease()
    done = weakref.finalize(lease, _give_back, pool, block, device)
    done.atexit = False  # at interpreter exit the process's memory goes anyway
    return lease


def _give_back(pool: HostBufferPool, block, device: torch.device) -> None:
    # The last alias may die right after a kernel reading it was queued, on any stream:
    # this runs once per layer, when streaming has ended, so wait for the device.
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception:  # a failed context: nothing more will read the memory
            pass
    if isinstance(block, FileBlock):
        block.release()
    else:
        pool.release_later(block)


class FlatWeights:
    """Parameters of one block, streamable as one unit.

    Args:
        name: the block's qualified name (for messages).
        params: ``(name relative to the block, parameter)`` pairs to stream.
        pool: where the pinned host copy comes from.
        device: the compute device.
        files: where the host copy goes when ``pool``'s budget refuses it (frozen weights
            only; see :mod:`offloadkit.layers.weight_files`); None: refused is an error.
    """

    def __init__(
        self, name: str, params, pool: HostBufferPool, device: torch.device, files: WeightFiles | None = None
    ) -> None:
        self.name = name
        self.device = device
        self.slots: list[_Slot] = []
        offset = 0
        for rel_name, p in params:
            offset = -(-offset // _ALIGN) * _ALIGN
            n = p.numel() * p.element_size()
            self.slots.append(_Slot(rel_name, p, offset, n))
            offset += n
        self.nbytes = offset
        self.files = files
        self.host: HostBlock | FileBlock | None = pool.acquire(max(self.nbytes, 1))
        trainable = any(s.param.requires_grad for s in self.slots)
        if self.host is None and files is not None:
            self.host = files.block(name, self.nbytes)
        if self.host is None:
            hint = (
                "raise host_budget_bytes, stream fewer layers, or give layer_offloading_dir: the copies past the "
                "budget then go to files there"
            )
            raise RuntimeError(
                f"offloadkit: the host-memory budget refuses {self.nbytes / 2**20:.0f} MiB for the "
                f"{'trainable' if trainable else 'frozen'} weights of {name} ({pool.budget.describe()}); {hint}"
            )
        self.on_disk = isinstance(self.host, FileBlock)
        self._pool = pool
        host = self.host.view(self.nbytes)
        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for s in self.slots:
            src = s.param.data.reshape(-1).view(torch.uint8)
            host[s.offset : s.offset + s.nbytes].copy_(src)  # the one and only copy to the host
            flat[s.offset : s.offset + s.nbytes].copy_(src)
        self.storage = flat.untyped_storage()
        self._device_views = []
        self._host_views = []
        # Evicted weights point at aliases of the host copy; each alias's storage holds this
        # lease, and the host block goes back to the pool only when the lease is gone (after
        # materialize(), once no state_dict value or detached weight uses an alias any more).
        self._lease: _Lease | None = _lease(pool, self.host, device)
        for s in self.slots:
            data = s.param.data
            self._device_views.append(
                torch.empty(0, dtype=data.dtype, device=device).set_(
                    self.storage, s.offset // data.element_size(), data.shape, data.stride()
                )
            )
            host_view = self.host_tensor(s)
            alias = device_alias_of_host(host_view, device, self._lease) if self.host.pinned else None
            if alias is None and s.param.requires_grad and device.type == "cuda" and not self.on_disk:
                # An evicted trainable weight may still be updated or given a gradient on the GPU
                # (a deferred optimizer step): it must stay addressable there.
                raise RuntimeError(
                    f"offloadkit: the GPU cannot address the host copy of {name}.{s.name} "
                    "(pinned memory mapped into the device's address space); stream trainable weights only with "
                    "use_pin_memory=True on a GPU with unified addressing"
                )
            self._host_views.append(alias if alias is not None else host_alias(host_view, self._lease))
        del flat
        self._self_ref = weakref.ref(self)
        # The last write-back queued at eviction: a device event, or a file write's completion.
        self.written: torch.cuda.Event | FutureCompletion | None = None
        self._point_params(resident=True)
        self.resident = True
        # The load has landed: a device event, or a file read's completion (host part, then device).
        self.ready: torch.cuda.Event | FutureCompletion | None = None
        self.alloc_stream: torch.cuda.Stream | None = None  # stream the resident memory belongs to
        self.consumed = True
        self._versions = self._current_versions()  # as loaded: a change means written in place

    # -- residency -----------------------------------------------------------------------
    def byte_view(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(self.storage, 0, (self.nbytes,), (1,))

    def load(self) -> None:
        """Allocate on the current stream and copy the host bytes in (on the device's
        host->device copy stream)."""
        compute = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.storage.resize_(self.nbytes)
        dst = self.byte_view()
        src = self.host.view(self.nbytes)
        if compute is None:
            dst.copy_(src)
            self.ready, self.alloc_stream = None, compute
        elif isinstance(self.host, FileBlock):
            # Read on an I/O thread into pinned staging, then copied in after the allocation
            # point: the new storage may reuse memory compute released before it.
            allocated = compute.record_event()
            self.ready = self.files.load(self.host, dst, allocated, copy_stream(self.device, "h2d"))
            self.alloc_stream = compute
        else:
            # After compute: the new block may reuse memory compute just released. The host
            # block orders it after a write-back that may still read the host copy.
            stream = copy_stream(self.device, "h2d")
            self.ready = queue_copy(dst, src, stream=stream, block=self.host, after=compute)
            self.alloc_stream = compute
        # The parameters keep pointing at the host copy until a consumer has waited for the
        # copy (:meth:`consume`): code that reads a weight outside its block meanwhile (a weight
        # also used elsewhere) must not see bytes still in flight.
        self.resident = True
        self.consumed = False

    def consume(self, stream: torch.cuda.Stream | None) -> None:
        """Point the parameters at the loaded bytes, used on ``stream`` (None: no streams, the
        CPU stand-in). The caller has made ``stream`` wait for :attr:`ready` (and timed it)."""
        if self.consumed:
            return
        if stream is not None and stream != self.alloc_stream:
            self.byte_view().record_stream(stream)  # freed later on the allocating stream
        self._point_params(resident=True)
        self._versions = self._current_versions()
        self.consumed = True

    def _current_versions(self) -> list[int]:
        return [version_of(slot.param) for slot in self.slots]

    @property
    def dirty(self) -> bool:
        """Whether a weight was changed in place on the device since the block was consumed."""
        return self.resident and self.consumed and self._versions != self._current_versions()

    def evict(self) -> bool:
        """Release the device bytes, writing them back to the host copy first when a weight
        changed in place (queued after the work on the current stream that changed it).

        Returns:
            Whether a write-back was queued.
        """
        if not self.resident:
            return False
        if not self.consumed and self.ready is not None:
            # A prefetched copy nobody waited for may still be writing: order reuse after it.
            order_after(self.alloc_stream, self.ready)
        dirty = self.dirty
        if dirty:
            self._queue_write_back()
            if not in_backward() and self.written is not None:
                # Outside backward (a forward after a failed backward, an eval pass): no end of
                # backward will order later reads and writes of the host copy after this copy.
                order_after(torch.cuda.current_stream(self.device), self.written)
        self.storage.resize_(0)
        self._point_params(resident=False)
        self.resident = False
        self.ready = None
        return dirty

    def _point_params(self, resident: bool) -> None:
        views = self._device_views if resident else self._host_views
        for slot, view in zip(self.slots, views):
            slot.param.data = view
            # Evicted parameters point at their host alias; the engine's policy must still
            # recognise the flat device storage (``.detach()``/``.data`` aliases saved in forward).
            slot.param.__dict__[STREAMED_STORAGE] = self.storage
            slot.param.__dict__[_STREAMED_BY] = self._self_ref

    def check_params(self) -> None:
        """Raise if something replaced a streamed parameter's data (e.g. ``model.to()``)."""
        pointed = self.resident and self.consumed
        for slot, dev, host in zip(self.slots, self._device_views, self._host_views):
            ptr = slot.param.data_ptr() if slot.param.numel() else None
            if ptr is not None and ptr not in (dev.data_ptr() if pointed else None, host.data_ptr()):
                raise RuntimeError(
                    f"offloadkit: {self.name}.{slot.name} no longer points at its streamed storage (was the "
                    "model moved or cast with .to()/.half()?); call streamer.remove() before changing weights' "
                    "device or dtype"
                )

    def adopt_replaced(self) -> None:
        """Bring back into the flat storage any resident parameter whose ``.data`` was replaced
        (PEFT's ``safe_merge``, DoRA and ``unmerge`` assign a new tensor instead of writing in place)."""
        if not (self.resident and self.consumed):
            return
        for slot, view in zip(self.slots, self._device_views):
            data = slot.param.data
            if data.numel() and data.data_ptr() == view.data_ptr():
                continue
            if data.shape != view.shape or data.dtype != view.dtype:
                raise RuntimeError(
                    f"offloadkit: {self.name}.{slot.name} was replaced by a {data.dtype}{list(data.shape)} tensor; "
                    f"a streamed weight keeps its {view.dtype}{list(view.shape)} layout (call streamer.remove() first)"
                )
            view.copy_(data)
            slot.param.data = view

    def write_back(self) -> None:
        """Copy the resident device bytes into the host copy (after weights were changed in place)."""
        if not (self.resident and self.consumed):
            return  # the parameters point at the host copy: changes went there
        self.adopt_replaced()
        if self.ready is not None:
            order_after(None, self.ready)
        self.host.wait_host()
        self.host.view(self.nbytes).copy_(self.byte_view())
        self._versions = self._current_versions()

    def _queue_write_back(self) -> None:
        """Queue the device bytes back into the host copy without waiting for it."""
        src = self.byte_view()
        dst = self.host.view(self.nbytes)
        if self.device.type != "cuda":
            dst.copy_(src)
            return
        compute = torch.cuda.current_stream(self.device)
        d2h = copy_stream(self.device, "d2h")
        # After compute: the bytes are final once the updates queued there ran. The storage is
        # released right after this call: the allocator must not reuse it before the copy read it.
        src.record_stream(d2h)
        if isinstance(self.host, FileBlock):
            # Through pinned staging, then into the file on an I/O thread; the file's next
            # read waits for that write.
            self.written = self.files.store(self.host, src, compute, d2h)
            return
        # The host block orders the copy after a load still reading the host copy, and the
        # next load after this copy.
        self.written = queue_copy(dst, src, stream=d2h, block=self.host, after=compute)

    def host_tensor(self, slot: _Slot) -> torch.Tensor:
        """The parameter's value in the host copy."""
        data = slot.param.data
        raw = self.host.view(self.nbytes)[slot.offset : slot.offset + slot.nbytes]
        return raw.view(data.dtype).view(data.shape)

    def materialize(self) -> None:
        """Make the block permanently resident (synchronously) and let the host copy go."""
        if not self.resident:
            compute = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            self.storage.resize_(self.nbytes)
            if compute is not None:
                self.host.order_device_use(compute)  # after a write-back still filling the host copy
            self.byte_view().copy_(self.host.view(self.nbytes))
            if compute is not None:
                compute.synchronize()
            self.resident = True
        elif self.ready is not None:
            order_after(None, self.ready)
        self.ready = None
        self.consumed = True
        self._point_params(resident=True)
        for slot in self.slots:
            slot.param.__dict__.pop(STREAMED_STORAGE, None)
            slot.param.__dict__.pop(_STREAMED_BY, None)
        # Aliases of the host copy handed out while evicted (state_dict values, detached
        # weights) may outlive this call: the block goes back when the last of them is gone.
        self._lease = None
        self._host_views = []
        self.host = None
