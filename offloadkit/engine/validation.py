"""Argument checks of :class:`~offloadkit.OffloadActivations`: ``ValueError`` naming the
argument, the value and the fix, before anything is built."""

from __future__ import annotations

from offloadkit.storage.disk import DiskOptions
from offloadkit.storage.factory import STORAGE_KINDS

__all__ = ["check_args"]

def check_args(**args) -> None:
    """``ValueError`` naming the argument, the value and the fix, before anything is built."""
    for name in ("use_pin_memory", "use_streams", "offload_cpu_tensors"):
        if not isinstance(args[name], bool):
            raise ValueError(f"{name}={args[name]!r} is invalid; pass True or False")
    stash = args["max_fwd_stash_size"]
    if not isinstance(stash, int) or isinstance(stash, bool) or stash < 1:
        raise ValueError(f"max_fwd_stash_size={stash!r} is invalid; it must be an int >= 1 "
                         "(it bounds the device tensors kept alive while their copies are in flight)")
    for name, what in (("prefetch", "entries fetched ahead"), ("prefetch_bytes", "bytes kept in flight ahead"),
                       ("host_budget_bytes", "a byte cap on host memory")):
        value = args[name]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name}={value!r} is invalid; pass an int >= 0 ({what}) or None"
                             + ("; sizes like '16GiB' are read by OffloadConfig" if isinstance(value, str) else ""))
    if args["storage"] not in STORAGE_KINDS:
        raise ValueError(f"storage={args['storage']!r} is invalid; choose one of {', '.join(STORAGE_KINDS)}")
    disk = args["disk"]
    if disk is not None and not isinstance(disk, DiskOptions):
        raise ValueError(f"disk={disk!r} is invalid; pass DiskOptions(directory=...) "
                         f"(e.g. disk=DiskOptions(directory={disk!r})) or None")
