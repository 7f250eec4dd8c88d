"""Where offloaded bytes live: host RAM (pinned, pooled) and, past the RAM budget, disk."""

from offloadkit.storage.base import Loaded, StorageTier, Stored
from offloadkit.storage.budget import HostMemoryBudget
from offloadkit.storage.disk import DiskFullError, DiskOptions, DiskTier
from offloadkit.storage.factory import STORAGE_KINDS, build_tier
from offloadkit.storage.host import HostTier
from offloadkit.storage.pool import HostBlock, HostBufferPool, size_class
from offloadkit.storage.tiered import TieredTier

__all__ = [
    "STORAGE_KINDS",
    "DiskFullError",
    "DiskOptions",
    "DiskTier",
    "TieredTier",
    "build_tier",
    "HostBlock",
    "HostBufferPool",
    "HostMemoryBudget",
    "HostTier",
    "Loaded",
    "StorageTier",
    "Stored",
    "size_class",
]
