"""The planner's options, read from the config keys of the same names (the run's budgets, which the
planner plans for, are the storage's: :class:`~offloadkit.storage.options.BudgetOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.options import Options, option
from offloadkit.storage.options import BudgetOptions

__all__ = ["BudgetOptions", "PlanOptions"]


@dataclass
class PlanOptions(Options):
    """Whether :func:`~offloadkit.prepare` plans the run, and for what step.

    Attributes:
        offload_plan: ``offload_plan``: "none" (the keys as given) or "auto" (the planner
            chooses checkpointing, offloading, streaming, loss chunks and MLP shards).
        seq_len: ``seq_len``: tokens per row the plan is for (None: given to ``prepare``;
            ``offloadkit train`` fills it from its training key of the same name).
        batch_size: ``batch_size``: rows per step the plan is for (``offloadkit train`` fills
            it from its training key of the same name).
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
