"""Stochastic rounding from fp32 to bf16.

bf16 is fp32 with the low 16 bits of the mantissa cut off. Rounding to nearest loses every
update smaller than half a bf16 step (about 0.2% of the weight): with small learning rates a
pure-bf16 AdamW stops moving weights that fp32 would still move. Rounding up with probability
equal to the cut-off fraction makes the rounding unbiased (the expected bf16 value is the fp32
value), so small updates survive on average, at the cost of noise of at most one bf16 step.

Adding a uniform 16-bit integer to the fp32 bit pattern and cutting the low 16 bits does
exactly that: the carry into bit 16 happens with probability (low bits) / 2**16. The sign
bit is untouched, so negative values round away from zero with the same probability as
positive ones; infinities stay infinite and a NaN stays a NaN.
"""

from __future__ import annotations

import torch

__all__ = ["stochastic_round_to_bf16"]

_LOW_BITS = 1 << 16
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as a signed 32-bit integer


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16, up or down with probability given by its distance to each.

    Args:
        x: an fp32 tensor.
        generator: the random source (on ``x``'s device); None: PyTorch's default one.

    Returns:
        A bf16 tensor of ``x``'s shape whose expected value is ``x`` (for finite values below
        bf16's largest).
    """
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic_round_to_bf16 takes fp32, not {x.dtype}; call .float() first")
    noise = torch.randint(0, _LOW_BITS, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = x.contiguous().view(torch.int32)
    # NaN payloads can sit in the low bits only: keep NaNs as they are.
    rounded = torch.where(torch.isnan(x), bits, (bits + noise) & _HIGH_MASK)
    # The low 16 bits are zero now, so the conversion to bf16 is exact.
    return rounded.view(torch.float32).to(torch.bfloat16)
