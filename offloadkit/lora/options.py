"""The fused LoRA path's options, read from the config key of the same name."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.options import Options, option

__all__ = ["LoraOptions"]


@dataclass
class LoraOptions(Options):
    """How PEFT's LoRA linear layers compute.

    Attributes:
        fused: ``fused_lora``: run each LoRA linear layer's base projection and adapter in the
            compute dtype in one autograd function (bf16 GEMMs with fp32 accumulation, the
            adapter's weight gradients in fp32) instead of PEFT's fp32 copy of every adapter's
            input: less memory saved per layer and less time at long context; outputs and
            gradients within bf16 tolerance of PEFT's, not bitwise. Layers it cannot fuse
            (QLoRA, DoRA, merged or several adapters) keep PEFT's forward. A list of module
            names (``[q_proj, k_proj, v_proj]``) fuses only the LoRA layers of those names.
            Unset (the default): off, unless ``offload_plan: auto`` turns it on for a model
            whose every LoRA linear layer it can fuse; ``false`` keeps PEFT's path then too.
    """

    fused: bool | list[str] | None = option(None, "fused_lora")

    def __post_init__(self) -> None:
        if self.fused is None:
            return
        if isinstance(self.fused, (list, tuple)):
            if not self.fused or not all(isinstance(n, str) and n for n in self.fused):
                raise ValueError(
                    f"{self.said('fused', self.fused)} is invalid; give true, false or a non-empty list of module "
                    "names (e.g. [q_proj, k_proj, v_proj])"
                )
            self.fused = list(self.fused)
        else:
            self._bool("fused")
