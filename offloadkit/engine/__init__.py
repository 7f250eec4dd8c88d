"""The activation offloading engine: saved-tensor hooks, policy, bookkeeping, stats."""

from offloadkit.engine.noop import NoOpManager
from offloadkit.engine.offload import OffloadActivations
from offloadkit.engine.policy import OffloadPolicy
from offloadkit.engine.stats import OffloadStats

__all__ = ["NoOpManager", "OffloadActivations", "OffloadPolicy", "OffloadStats"]
