"""``quantize_moe_experts``: a 4-bit base's mixture-of-experts weights in 4 bits too.

bitsandbytes quantizes a model's ``nn.Linear`` layers when it loads in 4 bits; experts kept
as one 3-D parameter per layer (``experts.gate_up_proj``, ``experts.down_proj``) stay in
16 bits. Here each such parameter is stored in NF4 (bitsandbytes' blockwise 4-bit, with
its statistics quantized too) and dequantized whenever the layer reads it, through a torch
parametrization: the experts compute with the NF4-rounded weights, as the 4-bit linear
layers do, and are frozen (a LoRA run trains adapters only).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["quantize_expert_parameters"]


class _Dequantized(nn.Module):
    """Parametrization: the stored NF4 bytes -> the weight in its compute dtype and shape."""

    def __init__(self, state, shape: torch.Size, dtype: torch.dtype) -> None:
        super().__init__()
        self.state = state
        self.shape = tuple(shape)
        self.dtype = dtype

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        return bnb_functional.dequantize_4bit(packed, self.state).to(self.dtype).reshape(self.shape)


def quantize_expert_parameters(model: nn.Module, kwargs: dict | None = None) -> int:
    """Every 3-D parameter of ``model`` (stacked experts) stored in 4 bits, read dequantized.

    Args:
        kwargs: the 4-bit settings (``bnb_4bit_quant_type``, ``bnb_4bit_use_double_quant``).

    Returns:
        How many parameters were quantized.
    """
    import bitsandbytes.functional as bnb_functional
    import torch.nn.utils.parametrize as parametrize

    kwargs = kwargs or {}
    quant_type = kwargs.get("bnb_4bit_quant_type", "nf4")
    double = kwargs.get("bnb_4bit_use_double_quant", True)
    count = 0
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.ndim != 3 or not param.is_floating_point():
                continue
            packed, state = bnb_functional.quantize_4bit(
                param.data.contiguous(), quant_type=quant_type, compress_statistics=double
            )
            setattr(module, name, nn.Parameter(packed, requires_grad=False))
            parametrize.register_parametrization(
                module, name, _Dequantized(state, param.shape, param.dtype), unsafe=True
            )
            count += 1
    return count
