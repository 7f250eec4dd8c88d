"""The optimizer offloading's options, read from the config keys of the same names."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.defaults import OPTIMIZER_STATE_BYTES
from offloadkit.options import Options, option

__all__ = ["OptimizerOptions"]


@dataclass
class OptimizerOptions(Options):
    """A full fine-tune's optimizer state in host memory, updated per parameter in backward.

    Attributes:
        enabled: ``optimizer_offloading``: with the Trainer mixins, replace the Trainer's
            AdamW by :class:`~offloadkit.optim.BackwardAdamW` (its SGD by ``BackwardSGD``):
            state in host memory, each parameter updated in backward (or at ``step()`` when the
            Trainer clips gradients).
        precision: ``optimizer_precision``: "params" (moments in the parameters' dtype: pure
            bf16 for a bf16 model, as torch.optim.AdamW), "compact" (bf16 moments; the update
            in fp32, rounded stochastically to bf16: 4 bytes a parameter, closer to fp32 than
            pure bf16) or "fp32_master" (fp32 master weights and moments for bf16/fp16
            parameters, in host memory).
        state_dir: ``optimizer_state_dir``: keep the state in memory-mapped files here (paged by
            the OS past what RAM holds: for hosts whose RAM cannot hold it; its copies then wait
            for the host); None: pinned host memory.
    """

    enabled: bool = option(False, "optimizer_offloading")
    precision: str = option("params", "optimizer_precision")
    state_dir: str | None = option(None, "optimizer_state_dir")

    def __post_init__(self) -> None:
        self._bool("enabled")
        if self.precision not in OPTIMIZER_STATE_BYTES:
            raise ValueError(
                f"{self.named('precision')}={self.precision!r} is not a precision; use params (moments in the "
                "parameters' dtype), compact (bf16 moments, stochastic rounding) or fp32_master (fp32 master weights "
                "and moments)"
            )
        self._path("state_dir")
