"""A LoRA linear layer that costs what its FLOPs cost: the base projection and the adapter in
the compute dtype, in one autograd function.

PEFT's ``Linear.forward`` casts each adapter's input to the adapter's dtype (fp32 by default
for a bf16 model), so every adapted projection writes and saves an fp32 copy of its input and
runs the rank-r matmuls in fp32; at long context those casts and the fp32 result are about
half of a step's linear time. Here the adapter's weights are cast to the input's dtype (they
are rank-r: a few MB), ``x @ A^T`` and ``(x @ A^T) @ B^T`` run as bf16 GEMMs with fp32
accumulation, the update is added into the base output by the GEMM itself (``addmm``), and
the adapter's weight gradients come out in fp32 from bf16 operands. Saved for backward: the
input (the same tensor the other projections of that input save: q, k and v share one) and
the rank-r activation, in the compute dtype.

Arithmetic differs from PEFT's by where it rounds (the rank-r activation is rounded to bf16;
the sum is formed in the GEMM's fp32 accumulator and rounded once): outputs and gradients
agree within bf16 tolerance (``tests/cpu/test_fused_lora.py``), not bitwise.

A layer runs PEFT's own forward whenever the fused one would not compute the same thing:
adapters disabled or merged, several active adapters or a mixed batch, DoRA and other
variants, an adapter with a bias (``lora_bias``), a base layer that is not a plain
``nn.Linear`` (QLoRA's 4-bit, 8-bit), a base weight that is trained or a DTensor when called
(tensor parallelism; FSDP2 calls a layer with its gathered weights, plain tensors: fused), or
an input in fp32 outside autocast (under autocast an fp32 layer computes in autocast's 16-bit
dtype, as PEFT's path does there).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from offloadkit.models.forwards import ForwardWraps

__all__ = ["FusedLoRA", "apply_fused_lora", "fusable_reason", "lora_linear", "unfusable_reason"]

_COMPUTE = (torch.bfloat16, torch.float16)
_MARK = "_offloadkit_fused_lora"


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with an fp32 result for 16-bit operands (fp32 accumulation either way)."""
    if a.dtype not in _COMPUTE:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())  # CPU has no 16-bit GEMM with an fp32 output


class _LoRALinear(torch.autograd.Function):
    """``y = x W^T + b + s (drop(x) A^T) B^T``, every matmul in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_a, lora_b, scaling: float):
        a = lora_a.to(x.dtype)
        b = lora_b.to(x.dtype)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xl2 = x2 if x_lora is None else x_lora.reshape(-1, shape[-1])
        u = xl2 @ a.t()  # [T, r]
        y = F.linear(x2, weight, bias)
        # Into y itself: the update summed in the GEMM's accumulator, without a copy of y (the
        # out= form, which FLOP counters see, rather than addmm_).
        torch.addmm(y, u, b.t(), alpha=scaling, out=y)
        ctx.scaling = scaling
        ctx.separate = x_lora is not None
        ctx.a_dtype, ctx.b_dtype = lora_a.dtype, lora_b.dtype
        ctx.save_for_backward(xl2, u, weight, lora_a, lora_b)
        ctx.x_shape = shape
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        xl2, u, weight, lora_a, lora_b = ctx.saved_tensors
        s = ctx.scaling
        g = grad_y.reshape(-1, grad_y.shape[-1])
        a = lora_a.to(g.dtype)
        b = lora_b.to(g.dtype)
        gb = g @ b  # [T, r]
        grad_x = grad_xl = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            if ctx.separate:
                grad_x = (g @ weight).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
                grad_xl = (gb @ a).mul_(s).reshape(ctx.x_shape) if ctx.needs_input_grad[1] else None
            else:
                grad_x = g @ weight
                torch.addmm(grad_x, gb, a, alpha=s, out=grad_x)
                grad_x = grad_x.reshape(ctx.x_shape)
        grad_a = grad_b = None
        if ctx.needs_input_grad[4]:
            grad_a = _mm_fp32(gb.t(), xl2).mul_(s).to(ctx.a_dtype)  # [r, in]
        if ctx.needs_input_grad[5]:
            grad_b = _mm_fp32(g.t(), u).mul_(s).to(ctx.b_dtype)  # [out, r]
        return grad_x, grad_xl, None, None, grad_a, grad_b, None


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    x_lora: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + bias + scaling (x_lora A^T) B^T`` in ``x``'s dtype, the base weight frozen.

    Args:
        x: the input, 16-bit.
        weight / bias: the frozen base projection.
        lora_a / lora_b: the adapter's ``[r, in]`` and ``[out, r]`` weights (any float dtype;
            their gradients come back in it).
        scaling: the adapter's scale (``alpha / r``).
        x_lora: the adapter's input when it differs from ``x`` (after dropout); None: ``x``.
    """
    return _LoRALinear.apply(x, x_lora, weight, bias, lora_a, lora_b, scaling)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype the layer computes in: its input's and weight's, or, for fp32 ones under
    autocast, autocast's (what PEFT's path computes in there too); None: not 16-bit."""
    if x.dtype in _COMPUTE and weight.dtype == x.dtype:
        return x.dtype
    kind = x.device.type
    if x.dtype == weight.dtype == torch.float32 and torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        return dtype if dtype in _COMPUTE else None
    return None


def fusable_reason(layer: Any, x: torch.Tensor, kwargs: dict) -> str | None:
    """Why ``layer`` (a PEFT LoRA ``Linear``) runs PEFT's forward for this call; None: fused."""
    if kwargs.get("adapter_names") is not None:
        return "a mixed batch of adapters"
    reason = _layer_reason(layer)
    if reason is not None:
        return reason
    if _compute_dtype(x, layer.get_base_layer().weight) is None:
        return "the input is not in the base weight's 16-bit dtype (nor cast to one by autocast)"
    return None


def _layer_reason(layer: Any) -> str | None:
    """Why ``layer`` runs PEFT's forward whatever its input; None: it can run fused."""
    if layer.disable_adapters or layer.merged:
        return "adapters disabled or merged"
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1:
        return "several active adapters"
    name = active[0]
    if name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name, False):
        return "DoRA or another LoRA variant"
    if layer.lora_B[name].bias is not None or layer.lora_A[name].bias is not None:
        return "the adapter has a bias (lora_bias)"
    base = layer.get_base_layer()
    if type(base) is not nn.Linear:
        return f"the base layer is a {type(base).__name__}, not nn.Linear"
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return "the base weight is trained"
    if _is_dtensor(base.weight) or _is_dtensor(layer.lora_A[name].weight):
        return "sharded weights"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out weights"
    return None


def unfusable_reason(model: nn.Module) -> str | None:
    """Why ``model`` would not run every LoRA linear layer fused (the first reason found), or
    None where each one would, in its weights' 16-bit dtype: the test ``offload_plan: auto``
    applies before choosing ``fused_lora`` itself."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:
        return "peft is not installed"
    others = {type(m).__name__ for m in model.modules() if isinstance(m, LoraLayer) and not isinstance(m, LoraLinear)}
    if others:
        return f"LoRA layers of other kinds ({', '.join(sorted(others))})"  # QLoRA's Linear4bit, ...
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    if not layers:
        return "no PEFT LoRA linear layers"
    for layer in layers:
        reason = _layer_reason(layer)
        if reason is None and layer.get_base_layer().weight.dtype not in _COMPUTE:
            reason = "32-bit weights (fused only under autocast)"
        if reason is not None:
            return reason
    return None


def _fused_forward(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A LoRA layer's forward: fused where it can, else PEFT's own (its class's forward). Bound
    to the layer as a partial, so a deep copy of the model binds its copy to the copied layer."""
    if args or set(kwargs) - {"adapter_names"} or fusable_reason(layer, x, kwargs) is not None:
        return type(layer).forward(layer, x, *args, **kwargs)
    kwargs.pop("adapter_names", None)
    name = next(n for n in layer.active_adapters if n in layer.lora_A)
    dropout = layer.lora_dropout[name]
    x_lora = None
    if not isinstance(dropout, nn.Identity) and dropout.training and getattr(dropout, "p", 0.0) > 0:
        x_lora = dropout(x)
    base = layer.get_base_layer()
    weight, bias = base.weight, base.bias
    dtype = _compute_dtype(x, weight)
    if x.dtype != dtype:  # fp32 under autocast: cast once, as autocast would for each matmul
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        x_lora = x_lora.to(dtype) if x_lora is not None else None
    return lora_linear(
        x, weight, bias, layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name], x_lora
    )


class FusedLoRA:
    """What :func:`apply_fused_lora` attached: ``remove()`` gives each layer PEFT's forward back
    (or whatever the instance held before).

    Attributes:
        layers: the LoRA layers that run fused where they can.
        skipped: layer name -> why it always runs PEFT's forward (its base layer's kind).
    """

    def __init__(self, layers: list[nn.Module], skipped: dict[str, str], wraps: ForwardWraps) -> None:
        self.layers = layers
        self.skipped = skipped
        self._wraps = wraps

    def remove(self) -> None:
        self._wraps.remove()
        self.layers = []


def apply_fused_lora(model: nn.Module, modules: Iterable[str] | None = None) -> FusedLoRA:
    """Run every PEFT LoRA ``Linear`` of ``model`` through :func:`lora_linear` where it can
    (see the module's docstring for when a call keeps PEFT's forward).

    Args:
        model: a PEFT model (or any module holding PEFT LoRA linear layers).
        modules: only the LoRA layers whose name ends with one of these (``"q_proj"``,
            ``"mlp.down_proj"``); None: all of them.

    Raises:
        ValueError: the model has no PEFT LoRA linear layer (of those names).
    """
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError as exc:  # pragma: no cover - peft is what makes LoRA layers
        raise ValueError("fused LoRA needs peft (pip install 'offloadkit[hf]')") from exc
    wanted = None if modules is None else tuple(modules)
    wraps = ForwardWraps(_MARK)
    layers: list[nn.Module] = []
    skipped: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLinear):
            continue
        if wanted is not None and not any(name == w or name.endswith("." + w) for w in wanted):
            continue
        base = module.get_base_layer()
        if type(base) is not nn.Linear:
            skipped[name] = f"its base layer is a {type(base).__name__}"
            continue
        if wraps.holds(module):
            raise ValueError(f"{name} already runs fused; remove() the first handle")
        if "forward" in module.__dict__:
            # Another wrapper (the tiled projections) would call PEFT's forward past ours.
            raise ValueError(f"{name}'s forward is already wrapped; apply the fused LoRA path first")
        layers.append(module)
    for module in layers:
        wraps.wrap(module, functools.partial(_fused_forward, module))
    if not layers and not skipped:
        named = "" if wanted is None else f" named {', '.join(wanted)}"
        raise ValueError(f"the model has no PEFT LoRA linear layers{named} to fuse")
    return FusedLoRA(layers, skipped, wraps)
