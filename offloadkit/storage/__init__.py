"""Where offloaded bytes live: host RAM (pinned, pooled) and, past the RAM budget, disk."""

from offloadkit.storage.base import Loaded, StorageTier, Stored
from offloadkit.storage.budget import HostMemoryBudget
from offloadkit.storage.host import HostTier
from offloadkit.storage.pool import HostBlock, HostBufferPool, size_class

__all__ = [
    "HostBlock",
    "HostBufferPool",
    "HostMemoryBudget",
    "HostTier",
    "Loaded",
    "StorageTier",
    "Stored",
    "size_class",
]
