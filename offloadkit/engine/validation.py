"""Argument checks of :class:`~offloadkit.OffloadActivations`: ``ValueError`` naming the
argument, the value and the fix, before anything is built."""

from __future__ import annotations

from torch import nn

from offloadkit.storage.base import StorageTier
from offloadkit.storage.budget import HostMemoryBudget
from offloadkit.storage.disk import DiskOptions
from offloadkit.storage.factory import STORAGE_KINDS

__all__ = ["check_args", "check_modules"]


def check_args(**args) -> None:
    """``ValueError`` naming the argument, the value and the fix, before anything is built."""
    for name in ("use_pin_memory", "use_streams", "offload_cpu_tensors", "measure_waits"):
        if not isinstance(args[name], bool):
            raise ValueError(f"{name}={args[name]!r} is invalid; pass True or False")
    stash = args["max_fwd_stash_size"]
    if not isinstance(stash, int) or isinstance(stash, bool) or stash < 1:
        raise ValueError(
            f"max_fwd_stash_size={stash!r} is invalid; it must be an int >= 1 "
            "(it bounds the device tensors kept alive while their copies are in flight)"
        )
    for name, what in (
        ("prefetch", "entries fetched ahead"),
        ("prefetch_bytes", "bytes kept in flight ahead"),
        ("host_budget_bytes", "a byte cap on host memory"),
    ):
        value = args[name]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(
                f"{name}={value!r} is invalid; pass an int >= 0 ({what}) or None"
                + ("; sizes like '16GiB' are read by OffloadConfig" if isinstance(value, str) else "")
            )
    if args["storage"] not in STORAGE_KINDS:
        raise ValueError(f"storage={args['storage']!r} is invalid; choose one of {', '.join(STORAGE_KINDS)}")
    disk = args["disk"]
    if disk is not None and not isinstance(disk, DiskOptions):
        raise ValueError(
            f"disk={disk!r} is invalid; pass DiskOptions(directory=...) "
            f"(e.g. disk=DiskOptions(directory={disk!r})) or None"
        )
    budget = args["budget"]
    if budget is not None and not isinstance(budget, HostMemoryBudget):
        raise ValueError(
            f"budget={budget!r} is invalid; pass a HostMemoryBudget (shared by several managers) "
            "or None; a byte cap goes in host_budget_bytes="
        )
    tier = args["tier"]
    if tier is not None and not isinstance(tier, StorageTier):
        raise ValueError(
            f"tier={tier!r} is invalid; pass a ready storage tier or None"
            + (f"; choose a kind with storage={tier!r}" if isinstance(tier, str) else "")
        )


def check_modules(head, exclude) -> list:
    """``head`` (a module or None) and ``exclude`` (modules) as given to
    :func:`~offloadkit.get_act_offloading_ctx_manager`; returns ``exclude`` as a list."""
    if head is not None and not isinstance(head, nn.Module):
        raise ValueError(
            f"head={head!r} is invalid; pass the output head module itself (e.g. head=model.lm_head) or None to find it"
        )
    if isinstance(exclude, nn.Module):
        exclude = [exclude]
    try:
        modules = list(exclude)
    except TypeError:
        raise ValueError(f"exclude={exclude!r} is invalid; pass a list of modules") from None
    for m in modules:
        if not isinstance(m, nn.Module):
            hint = (
                " (a class: pass its instances, e.g. [m for m in model.modules() if isinstance(m, C)])"
                if isinstance(m, type)
                else ""
            )
            raise ValueError(f"exclude contains {m!r}, which is not a module instance{hint}")
    return modules
