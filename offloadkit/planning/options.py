"""The planner's options and the run's budgets, read from the config keys of the same names."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.options import Options, option

__all__ = ["BudgetOptions", "PlanOptions"]


@dataclass
class PlanOptions(Options):
    """Whether :func:`~offloadkit.prepare` plans the run, and for what step.

    Attributes:
        offload_plan: ``offload_plan``: "none" (the keys as given) or "auto" (the planner
            chooses checkpointing, offloading, streaming, loss chunks and MLP shards).
        seq_len: ``seq_len``: tokens per row the plan is for (None: given to ``prepare``).
        batch_size: ``batch_size``: rows per step the plan is for.
    """

    offload_plan: str = option("none", "offload_plan")
    seq_len: int | None = option(None, "seq_len")
    batch_size: int = option(1, "batch_size")

    def __post_init__(self) -> None:
        if self.offload_plan not in ("none", "auto"):
            raise ValueError(
                f"offload_plan={self.offload_plan!r} is invalid; use auto (plan from the model, seq_len "
                "and this machine's budgets) or none"
            )
        self._int("seq_len", 1, "tokens per row", optional=True)
        self._int("batch_size", 1, "rows per step")


@dataclass
class BudgetOptions(Options):
    """What the run may hold in host and GPU memory.

    Attributes:
        host_budget_bytes: ``host_budget_bytes``: cap on host RAM for offloaded bytes and
            streamed weights; None: what is available less ``host_min_free_bytes``.
        host_min_free_bytes: ``host_min_free_bytes``: system RAM that must stay available
            (None: 10% of RAM, at least 2 GiB).
        gpu_budget_bytes: ``gpu_budget_bytes``: cap on this process's GPU memory, enforced by
            the caching allocator's per-process fraction.
    """

    host_budget_bytes: int | None = option(None, "host_budget_bytes")
    host_min_free_bytes: int | None = option(None, "host_min_free_bytes")
    gpu_budget_bytes: int | None = option(None, "gpu_budget_bytes")

    def __post_init__(self) -> None:
        for name in ("host_budget_bytes", "host_min_free_bytes", "gpu_budget_bytes"):
            self._int(name, 0, "bytes", optional=True)
