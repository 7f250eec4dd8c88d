"""Context parallelism's options, read from the config keys of the same names."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.options import Options, option

__all__ = ["ParallelOptions"]

ROTATIONS = ("auto", "allgather", "alltoall")


@dataclass
class ParallelOptions(Options):
    """One sequence split over every rank of the run (ring attention), through the Trainer.

    Attributes:
        enabled: ``context_parallel``: split each sequence over the ranks of the
            process group (``torchrun``, ``accelerate launch``). With the Trainer mixins (and
            ``offloadkit train``) every rank's batch is run in turn, each split over all the
            ranks: the step trains on the same sequences as without it, every rank holding
            ``1/world`` of each. Needs a Hugging Face causal LM with full causal attention and
            right padding (no packed documents).
        rotation: ``context_parallel_rotation``: how ring attention moves keys and values:
            "allgather" (one all-gather a layer), "alltoall" (one exchange a ring step: less
            GPU memory at long context) or "auto" (the plan's choice under ``offload_plan:
            auto``, else allgather).
    """

    enabled: bool = option(False, "context_parallel")
    rotation: str = option("auto", "context_parallel_rotation")

    def __post_init__(self) -> None:
        self._bool("enabled")
        if self.rotation not in ROTATIONS:
            raise ValueError(
                f"{self.said('rotation', self.rotation)} is not a rotation; use allgather (one all-gather a "
                "layer), alltoall (less memory at long context) or auto"
            )
