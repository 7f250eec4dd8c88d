"""What the run may hold in host and GPU memory, read from the config keys of the same names;
the host budget's component spends them, the planner plans for them."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.options import Options, option

__all__ = ["BudgetOptions"]


@dataclass
class BudgetOptions(Options):
    """What the run may hold in host and GPU memory.

    Attributes:
        host_budget_bytes: ``host_budget_bytes``: cap on host RAM for offloaded bytes and
            streamed weights; None: what is available less ``host_min_free_bytes``.
        host_min_free_bytes: ``host_min_free_bytes``: system RAM that must stay available
            (None: 10% of RAM, at least 2 GiB); lower it on VMs whose RAM grows as it is used.
        gpu_budget_bytes: ``gpu_budget_bytes``: cap on this process's GPU memory, enforced by
            the caching allocator's per-process fraction: a run on a larger GPU behaves, and
            fails, as on a GPU of this size, and ``offload_plan: auto`` plans for it.
    """

    host_budget_bytes: int | None = option(None, "host_budget_bytes")
    host_min_free_bytes: int | None = option(None, "host_min_free_bytes")
    gpu_budget_bytes: int | None = option(None, "gpu_budget_bytes")

    def __post_init__(self) -> None:
        for name in ("host_budget_bytes", "host_min_free_bytes", "gpu_budget_bytes"):
            self._int(name, 0, "bytes", optional=True)
