"""``quantize_moe_experts``: a quantized base's mixture-of-experts weights quantized too.

bitsandbytes quantizes a model's ``nn.Linear`` layers when it loads in 4 or 8 bits; experts
kept as one 3-D parameter per layer (``experts.gate_up_proj``, ``experts.down_proj``) stay
in 16 bits. Here each such parameter is stored in NF4 (bitsandbytes' blockwise 4-bit, its
statistics quantized too) or in int8 (row-wise absmax, as LLM.int8 stores weights), and
dequantized whenever the layer reads it, through a torch parametrization: the experts
compute with the rounded weights, as the quantized linear layers do, and are frozen (a LoRA
run trains adapters only).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["quantize_expert_parameters"]


class _DequantizedInt8(nn.Module):
    """Parametrization: int8 rows and their absmax -> the weight in its compute dtype."""

    def __init__(self, row_stats: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("row_stats", row_stats)
        self.shape = tuple(shape)
        self.dtype = dtype

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        rows = packed.reshape(-1, self.shape[-1])
        stats: torch.Tensor = self.row_stats  # type: ignore[assignment]  # a buffer
        return bnb_functional.int8_vectorwise_dequant(rows, stats).to(self.dtype).reshape(self.shape)


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


def quantize_expert_parameters(model: nn.Module, kwargs: dict | None = None, bits: int = 4) -> int:
    """Every 3-D parameter of ``model`` (stacked experts) stored in ``bits`` bits, read
    dequantized.

    Args:
        kwargs: the 4-bit settings (``bnb_4bit_quant_type``, ``bnb_4bit_use_double_quant``).
        bits: 4 (NF4) or 8 (int8 rows).

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
            parametrization: nn.Module
            if bits == 8:
                rows = param.data.reshape(-1, param.shape[-1]).to(torch.float16)
                packed, row_stats, _ = bnb_functional.int8_vectorwise_quant(rows)
                parametrization = _DequantizedInt8(row_stats, param.shape, param.dtype)
            else:
                packed, state = bnb_functional.quantize_4bit(
                    param.data.contiguous(), quant_type=quant_type, compress_statistics=double
                )
                parametrization = _Dequantized(state, param.shape, param.dtype)
            setattr(module, name, nn.Parameter(packed, requires_grad=False))
            parametrize.register_parametrization(module, name, parametrization, unsafe=True)
            count += 1
    return count
