"""The run's host-memory budget as :func:`~offloadkit.prepare` builds it: one
:class:`~offloadkit.storage.HostMemoryBudget` that offloaded activations and streamed weights
reserve from together."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from offloadkit.component import Component
from offloadkit.storage.budget import HostMemoryBudget
from offloadkit.storage.footprint import storage_footprint
from offloadkit.storage.options import BudgetOptions

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = ["HOST_BUDGET"]


def build_host_budget(model: nn.Module, options: BudgetOptions, run: OffloadRuntime) -> HostMemoryBudget:
    return HostMemoryBudget(options.host_budget_bytes, options.host_min_free_bytes)


def _keep(budget: Any) -> None:
    """Nothing to detach: the budget only counts bytes its clients hold."""


HOST_BUDGET = Component(
    name="host_budget",
    options=BudgetOptions,
    why_here="one host RAM budget, made before the two that share it: activation offloading and layer streaming",
    build=build_host_budget,
    remove=_keep,
    footprint=storage_footprint,
)
