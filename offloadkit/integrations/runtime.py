"""Former home of the composition root, now :mod:`offloadkit.compose`; kept so that existing
imports keep working."""

from offloadkit.compose import OffloadRuntime, plan_for, prepare

__all__ = ["OffloadRuntime", "plan_for", "prepare"]
