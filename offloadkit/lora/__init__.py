"""LoRA linear layers computed in the compute dtype (``fused_lora``): :func:`apply_fused_lora`,
:func:`lora_linear`."""

from offloadkit.lora.fused import FusedLoRA, apply_fused_lora, lora_linear

__all__ = ["FusedLoRA", "apply_fused_lora", "lora_linear"]
