"""Sequence-tiled MLP: a token-wise module run over shards of the sequence.

At long lengths one MLP intermediate (``seq x intermediate_size``, 512K x 14336 for an 8B
model) is larger than everything else in a layer. The tiled module runs forward shard by
shard without building a graph and saves only its input; backward recomputes each shard
under ``torch.enable_grad()`` and backpropagates it. Input gradients land in one
preallocated buffer. Parameter gradients are summed over shards (in fp32 for
lower-precision parameters) and handed to autograd once, as ordinary gradients of the
tiled call: accumulation into existing ``.grad`` (gradient accumulation), gradient hooks
and DDP's reducer see one gradient per parameter per backward, exactly as without tiling.
The RNG state is replayed in backward, so dropout inside the module (LoRA dropout) draws
the same masks as in forward.

Automatic shard count: ``ceil(tokens * width / 2**28)``, where width is the widest
``in_features`` or ``out_features`` of the module's linear layers (the intermediate size; the input width
when there are none), so one shard's widest tensor has at most 2**28 elements (512 MiB in
bf16). When that gives one shard the module runs untiled (no recompute cost).

Inside a checkpointed layer the tiled forward runs again during the layer's recompute, so
the MLP's forward is computed three times per step instead of two.

Past the MLP, what a LoRA layer saves grows with length through its norms (fp32 upcasts of
the input) and its attention projections (PEFT keeps an fp32 copy of each adapter's input):
about 100 KB per token for an 8B layer, 50 GiB at 512K tokens. ``projections=True`` runs
those token-wise modules over shards too, so each saves only its bf16 input; attention
itself (SDPA or flash) sees the whole sequence.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable

import torch
from torch import nn

from offloadkit.models.blocks import find_blocks
from offloadkit.models.heads import unwrap_model

__all__ = ["apply_tiled_mlp", "tiled_forward", "auto_num_shards", "TiledMLP", "SHARD_ELEMENTS"]

SHARD_ELEMENTS = 2**28
_MARK = "_offloadkit_tiled_mlp"


def auto_num_shards(tokens: int, width: int) -> int:
    """Shards so that one shard's ``tokens x width`` tensor has at most 2**28 elements."""
    return max(1, math.ceil(tokens * width / SHARD_ELEMENTS))


def _bounds(length: int, num_shards: int) -> list[tuple[int, int]]:
    num_shards = max(1, min(num_shards, length))
    size, extra = divmod(length, num_shards)
    out, start = [], 0
    for i in range(num_shards):
        n = size + (1 if i < extra else 0)
        out.append((start, n))
        start += n
    return out


def _check(y, xs: torch.Tensor) -> torch.Tensor:
    if not torch.is_tensor(y) or y.shape[:-1] != xs.shape[:-1]:
        got = type(y).__name__ if not torch.is_tensor(y) else f"shape {tuple(y.shape)}"
        raise TypeError(f"a tiled module must map [..., S, H] to [..., S, H'] token-wise; for input "
                        f"{tuple(xs.shape)} it returned {got}")
    return y


def _sharded(fn: Callable, x: torch.Tensor, bounds) -> torch.Tensor:
    dim = x.dim() - 2
    out = None
    for start, n in bounds:
        xs = x.narrow(dim, start, n)
        y = _check(fn(xs), xs)
        if out is None:
            out = y.new_empty(x.shape[:-1] + y.shape[-1:])
        out.narrow(dim, start, n).copy_(y)
        del y
    return out


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class TiledMLP(torch.autograd.Function):
    """``TiledMLP.apply(fn, num_shards, x, *params)``: ``fn(x)`` computed over sequence
    shards, with gradients for ``x`` and for ``params`` (the trainable parameters ``fn``
    uses). Prefer :func:`tiled_forward`."""

    @staticmethod
    def forward(ctx, fn, num_shards, x, *params):
        bounds = _bounds(x.shape[-2], num_shards)
        ctx.fn, ctx.bounds, ctx.params = fn, bounds, params
        ctx.rng = _rng_state(x.device)
        ctx.save_for_backward(x)
        return _sharded(fn, x, bounds)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        params, dim = ctx.params, x.dim() - 2
        need_x = ctx.needs_input_grad[2]
        need_p = ctx.needs_input_grad[3:]
        wanted = [p for p, need in zip(params, need_p) if need]
        grad_x = torch.empty_like(x) if need_x else None
        acc: list[torch.Tensor | None] = [None] * len(wanted)
        cpu_rng, cuda_rng = ctx.rng
        devices = [x.device] if cuda_rng is not None else []
        # Saved-tensor hooks of an enclosing offloading context must not move the shard's
        # tensors: they are used right here.
        with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t), torch.enable_grad():
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, x.device)
            for start, n in ctx.bounds:
                xs = x.narrow(dim, start, n).detach().requires_grad_(need_x)
                ys = ctx.fn(xs)
                inputs = ([xs] if need_x else []) + wanted
                grads = [None] * len(inputs)
                if ys.requires_grad:
                    grads = list(torch.autograd.grad(ys, inputs, grad_out.narrow(dim, start, n), allow_unused=True))
                del ys
                if need_x:
                    gx = grads.pop(0)
                    target = grad_x.narrow(dim, start, n)
                    if gx is None:
                        target.zero_()
                    else:
                        target.copy_(gx)
                for i, g in enumerate(grads):
                    if g is None:
                        continue
                    if acc[i] is None:
                        low = g.dtype in (torch.float16, torch.bfloat16) and len(ctx.bounds) > 1
                        acc[i] = g.float() if low else g
                    else:
                        acc[i].add_(g)
        out_p = iter(None if a is None else a.to(p.dtype) for a, p in zip(acc, wanted))
        grads_p = [next(out_p) if need else None for need in need_p]
        return (None, None, grad_x, *grads_p)


def tiled_forward(fn: Callable, x: torch.Tensor, num_shards: int, params=None) -> torch.Tensor:
    """``fn(x)`` over ``num_shards`` shards of the sequence dimension (``x.shape[-2]``),
    holding one shard's intermediates at a time in forward and in backward.

    Args:
        fn: a token-wise function, e.g. ``mlp.forward``.
        x: ``[..., S, H]``.
        num_shards: shards of S (at most S).
        params: the trainable tensors ``fn`` uses (default: none); they get gradients.

    Example:
        >>> y = tiled_forward(model.model.layers[0].mlp.forward, x, 8,
        ...                   [p for p in model.model.layers[0].mlp.parameters() if p.requires_grad])
    """
    params = tuple(params or ())
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return TiledMLP.apply(fn, num_shards, x, *params)
    return _sharded(fn, x, _bounds(x.shape[-2], num_shards))


def _width(module: nn.Module) -> int | None:
    """The widest feature dimension of the module's linear layers (inputs too: a LoRA
    projection's fp32 input copy is as wide as its input)."""
    widths: list[int] = [getattr(m, attr) for m in module.modules() for attr in ("in_features", "out_features")
                         if isinstance(getattr(m, attr, None), int)]
    return max(widths) if widths else None


class TiledMLPHandle:
    """What :func:`apply_tiled_mlp` attached; ``remove()`` restores every module's forward.

    Attributes:
        modules: ``(qualified name, module)`` pairs that run tiled.
        num_shards: the fixed shard count, or None for automatic.
    """

    def __init__(self, modules, num_shards):
        self.modules = modules
        self.num_shards = num_shards
        self._saved: list[tuple[nn.Module, object]] = []

    def _attach(self) -> None:
        for name, module in self.modules:
            if _MARK in module.__dict__:
                raise ValueError(f"{name} is already tiled by offloadkit; remove() the first handle")
        for name, module in self.modules:
            previous = module.__dict__.get("forward")
            wrapper = functools.partial(self._call, module, module.forward, _width(module), self.num_shards)
            module.forward = wrapper
            module.__dict__[_MARK] = wrapper
            self._saved.append((module, previous))

    def remove(self) -> None:
        """Restore every module's forward."""
        for module, previous in self._saved:
            ours = module.__dict__.pop(_MARK, None)
            if ours is not None and module.__dict__.get("forward") is ours:
                if previous is None:
                    del module.forward
                else:
                    module.forward = previous  # type: ignore[method-assign, assignment]
        self._saved.clear()

    def shards_for(self, x: torch.Tensor, width: int | None, fixed: int | None = None) -> int:
        if fixed is not None:
            return min(fixed, x.shape[-2])
        tokens = x.numel() // x.shape[-1]
        return min(auto_num_shards(tokens, width or x.shape[-1]), x.shape[-2])

    def _call(self, module: nn.Module, original: Callable, width: int | None, fixed: int | None, *args, **kwargs):
        if len(args) != 1 or kwargs or not torch.is_tensor(args[0]) or args[0].dim() < 2:
            return original(*args, **kwargs)
        x = args[0]
        shards = self.shards_for(x, width, fixed)
        if shards <= 1 and fixed is None:
            return original(x)
        params = [p for p in module.parameters() if p.requires_grad]
        return tiled_forward(original, x, shards, params)


def _parse_shards(num_shards) -> int | None:
    if num_shards is None or num_shards == "auto":
        return None
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards={num_shards!r} must be an integer >= 1, 'auto' or None")
    return num_shards


def _linear_like(module: nn.Module) -> bool:
    """A linear layer, also wrapped (PEFT's LoRA layers keep the original in ``base_layer``)."""
    base = getattr(module, "base_layer", module)
    return isinstance(getattr(base, "in_features", None), int) and isinstance(getattr(base, "out_features", None), int)


def _projection_parts(name: str, block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The token-wise modules of a decoder layer besides its MLP: the layer's own norms
    (direct children named ``*norm``) and the attention module's linear projections."""
    parts = [(f"{name}.{n}", m) for n, m in block.named_children() if n.lower().endswith("norm")]
    for attr in ("self_attn", "attn", "attention"):
        attn = getattr(block, attr, None)
        if isinstance(attn, nn.Module):
            parts += [(f"{name}.{attr}.{n}", m) for n, m in attn.named_children() if _linear_like(m)]
            break
    return parts


def apply_tiled_mlp(
    model: nn.Module,
    num_shards: int | str | None = None,
    predicate: Callable[[str, nn.Module], bool] | None = None,
    projections: bool = False,
) -> TiledMLPHandle:
    """Run the MLP of every decoder layer (``layer.mlp``) over sequence shards.

    Each module's ``forward`` is replaced on the instance (no class is patched); modules
    called with anything but one ``[..., S, H]`` tensor run as before.

    Args:
        model: a Hugging Face model (PEFT and other wrappers are looked through) or any
            model whose blocks have an ``mlp``.
        num_shards: shards per call; None or "auto": ``ceil(tokens * width / 2**28)`` for
            each module's width, untiled when that is 1.
        predicate: ``predicate(name, module) -> bool`` choosing the modules instead, e.g.
            ``lambda n, m: n.endswith(("mlp", "layernorm"))`` to tile the norms' fp32
            upcasts too. Chosen modules must be token-wise.
        projections: also tile each layer's norms and attention projections (q/k/v/o with
            their adapters); with automatic shards they run untiled below ``2**28 / hidden``
            tokens (64K for hidden 4096), so short sequences pay nothing.

    Returns:
        A :class:`TiledMLPHandle`; ``handle.remove()`` restores the modules.

    Example:
        >>> handle = apply_tiled_mlp(model, num_shards="auto")
        >>> model(input_ids, labels=labels).loss.backward()
        >>> handle.remove()
    """
    shards = _parse_shards(num_shards)
    base = unwrap_model(model)
    if predicate is not None:
        modules = [(n, m) for n, m in base.named_modules() if n and predicate(n, m)]
        how = "the predicate"
    else:
        modules = [(f"{name}.mlp", block.mlp) for name, block in find_blocks(base)
                   if isinstance(getattr(block, "mlp", None), nn.Module)]
        how = "layer.mlp of the decoder layers"
    if projections:
        for name, block in find_blocks(base):
            modules += _projection_parts(name, block)
    if not modules:
        raise ValueError(f"no modules to tile in {type(base).__name__} by {how}; "
                         "choose them with predicate=lambda name, module: ...")
    attn = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if attn == "eager":
        warnings.warn("offloadkit: attention is 'eager', which builds [batch, heads, seq, seq] scores; at the "
                      "lengths tiled_mlp is for, load the model with attn_implementation='sdpa' or "
                      "'flash_attention_2'", UserWarning, stacklevel=2)
    handle = TiledMLPHandle(modules, shards)
    handle._attach()
    return handle
