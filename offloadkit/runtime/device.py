"""Thin, explicit wrappers over the CUDA runtime pieces offloadkit relies on.

Everything stream-related goes through :func:`current_stream` so that callers always
order work against the stream that is current *now* (FSDP2, checkpoint recompute and
custom autograd functions may run compute on a non-default stream).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

import torch

__all__ = [
    "accelerator_available",
    "device_alias_of_host",
    "host_alias",
    "empty_host_cache",
    "current_stream",
    "host_register",
    "host_unregister",
    "is_accelerator_tensor",
    "use_expandable_segments",
    "PAGE_SIZE",
]

PAGE_SIZE = mmap.PAGESIZE  # 4 KiB on x86, 64 KiB on some Arm systems


@functools.lru_cache(maxsize=1)
def accelerator_available() -> bool:
    """True when a CUDA device can be used by this process."""
    return torch.cuda.is_available()


def is_accelerator_tensor(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def current_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The live current stream of ``device`` (None for CPU tensors)."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device)


@functools.lru_cache(maxsize=1)
def _cudart():
    try:
        rt = torch.cuda.cudart()
    except Exception:  # CPU-only build, or no driver
        return None
    if not (hasattr(rt, "cudaHostRegister") and hasattr(rt, "cudaHostUnregister")):
        return None
    return rt


def host_register(ptr: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` of host memory at ``ptr`` in place. Returns False if unsupported.

    PyTorch's pinned allocator rounds every request up to a power of two; registering
    exact-size page-aligned buffers keeps host RAM use equal to what is offloaded.
    """
    rt = _cudart()
    if rt is None:
        return False
    err = rt.cudaHostRegister(ptr, nbytes, 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        # The failure is also recorded as the runtime's "last error", which PyTorch's next
        # launch check would report as its own failure: clear it.
        _clear_last_cuda_error()
        return False
    return True


@functools.lru_cache(maxsize=1)
def _loaded_cudart():
    """The CUDA runtime library PyTorch already loaded (never loads a new one)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
    return None


def _clear_last_cuda_error() -> None:
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()


class _Lent:
    """Memory lent to PyTorch as a device array: a tensor made from it keeps this object, and
    so ``owner``, alive for as long as the tensor's storage lives."""

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }


def device_alias_of_host(host: torch.Tensor, device: torch.device, owner: object) -> torch.Tensor | None:
    """A ``device`` tensor over page-locked ``host`` memory (zero-copy, read over the bus), or
    None where the GPU cannot address it at the same pointer.

    Streamed weights point at such aliases while evicted: they stay "on the GPU" for code
    that moves or inspects the model (``model.to("cuda")`` is a no-op, PEFT's merge reads and
    writes them), at the price of slow access outside forward and backward. The alias's
    storage holds ``owner`` (whatever keeps the host memory allocated) until the last tensor
    using it is gone, so a ``state_dict()`` value kept after streaming ends stays valid.
    """
    if device.type != "cuda" or host.device.type != "cpu":
        return None
    lib = _loaded_cudart()
    if lib is None:
        return None
    dptr = ctypes.c_void_p()
    err = lib.cudaHostGetDevicePointer(ctypes.byref(dptr), ctypes.c_void_p(host.data_ptr()), 0)
    if err != 0 or dptr.value != host.data_ptr():
        _clear_last_cuda_error()
        return None
    nbytes = host.numel() * host.element_size()
    try:
        raw = torch.as_tensor(_Lent(host.data_ptr(), nbytes, owner))
    except (RuntimeError, TypeError, ValueError):
        _clear_last_cuda_error()
        return None
    if raw.device != device or (nbytes and raw.data_ptr() != host.data_ptr()):
        return None
    return raw.view(host.dtype).as_strided(host.shape, host.stride())


def host_alias(host: torch.Tensor, owner: object) -> torch.Tensor:
    """A CPU tensor over ``host``'s memory whose storage holds ``owner`` alive (see
    :func:`device_alias_of_host`)."""
    nbytes = host.numel() * host.element_size()
    if nbytes == 0:
        return host.detach().clone()
    lent = (ctypes.c_uint8 * nbytes).from_address(host.data_ptr())
    lent.owner = owner  # type: ignore[attr-defined]  # ctypes arrays take attributes; frombuffer keeps the array
    return torch.frombuffer(lent, dtype=torch.uint8).view(host.dtype).as_strided(host.shape, host.stride())


def empty_host_cache() -> None:
    """Give PyTorch's cached pinned host blocks back (where this PyTorch can)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def host_unregister(ptr: int) -> None:
    rt = _cudart()
    if rt is not None:
        rt.cudaHostUnregister(ptr)


def use_expandable_segments(on: bool = True) -> bool:
    """Let the CUDA caching allocator grow segments in place (``expandable_segments:True``)
    for the segments it maps from now on, unless the user configured the allocator
    (``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``). Under a memory cap, fixed-size
    segments leave room that no large request fits (a 1.75 GiB request failed with 2.6 GiB
    reserved and free, at 16 GiB); at long context they strand room too (a 512K step reserved
    1.66x what it allocated). ``on=False`` puts the default back.

    Switching on also gives back the memory cached and free at that moment: it lies in segments
    mapped before (a model built in fp32 and cast to bf16 leaves its fp32 copies freed there, in
    pieces no large request fits), and the run's own allocations then map segments that grow in
    place beside what is live instead of beside those holes.

    Returns:
        Whether the setting was applied.
    """
    if not torch.cuda.is_available():
        return False
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return False
    setting = f"expandable_segments:{on}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(setting)
    else:  # torch < 2.12
        torch.cuda.memory._set_allocator_settings(setting)
    if on and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return True
