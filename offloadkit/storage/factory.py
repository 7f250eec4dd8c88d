"""Build a storage tier by name: ``"ram"``, ``"disk"`` or ``"tiered"``."""

from __future__ import annotations

from offloadkit.storage.budget import HostMemoryBudget
from offloadkit.storage.disk import DiskOptions, DiskTier
from offloadkit.storage.host import HostTier
from offloadkit.storage.pool import HostBufferPool
from offloadkit.storage.tiered import TieredTier

__all__ = ["STORAGE_KINDS", "build_tier"]

STORAGE_KINDS = ("ram", "disk", "tiered")


def build_tier(
    kind: str, budget: HostMemoryBudget, *, pin_memory: bool, use_streams: bool, disk: DiskOptions | None = None
):
    """A tier of ``kind`` sharing ``budget``.

    * ``ram``: pinned host buffers; past the budget tensors stay on the device.
    * ``disk``: everything to files, staged through a few host buffers.
    * ``tiered``: RAM up to the budget, the oldest entries moved to disk past it.
    """
    if kind not in STORAGE_KINDS:
        raise ValueError(f"storage={kind!r} is unknown; choose one of {', '.join(STORAGE_KINDS)}")
    if kind == "ram":
        if disk is not None:
            raise ValueError("disk options were given but storage='ram'; use storage='disk' or 'tiered'")
        return HostTier(HostBufferPool(pin_memory, budget), use_streams)
    disk_tier = DiskTier(budget, disk, pin_memory=pin_memory, use_streams=use_streams)
    if kind == "disk":
        return disk_tier
    return TieredTier(HostTier(HostBufferPool(pin_memory, budget), use_streams), disk_tier)
