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

Inside a checkpointed layer the tiled forward runs again during the layer's recompute, where
only its saved input is wanted: nothing reads the recomputed output when the MLP's output only
meets the residual add (which saves nothing) before the layer returns. For decoder layers known
to end that way (``OUTPUT_ONLY_ADDED``: Llama, Mistral, Qwen2/3, Gemma) under offloadkit's
non-selective checkpointing of each layer on its own, the recompute saves the input and skips
the shards, so the MLP's forward is computed twice per step, not three times. It runs in full
wherever the output may be read: a checkpointed unit larger than the layer (``block_types`` or
a predicate naming a wrapper or a container of layers, where the next layer reads it), a
forward hook on the MLP or a global one (``register_module_forward_hook``), selective
checkpointing, Hugging Face's checkpointing, layers that norm or scale the MLP's output with
saved tensors, projections, MoE experts.

Past the MLP, what a LoRA layer saves grows with length through its norms (fp32 upcasts of
the input) and its attention projections (PEFT keeps an fp32 copy of each adapter's input):
about 100 KB per token for an 8B layer, 50 GiB at 512K tokens. ``projections=True`` runs
those token-wise modules over shards too, so each saves only its bf16 input; attention
itself (SDPA or flash) sees the whole sequence.

A tiled module fed by a tiled norm (modules named ``*norm``: q, k and v after the input
norm, the MLP after the post-attention norm) saves the norm's input, which the norm saves
anyway, instead of the norm's output, and rebuilds its input shard by shard in backward by
running the norm over the norm's own shards (``longctx/shards.py``): the same shapes, so the
same bytes. A layer then saves two ``[S, H]`` tensors fewer (16 KiB a token for an 8B model)
for four norm forwards more in backward (q, k and v each rebuild their input, the MLP its own;
a norm is a pass over ``[S, H]``, far below a projection's cost).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable

import torch
from torch import nn

from offloadkit.longctx.shards import (
    Prenorm,
    PrenormRows,
    Recorded,
    run_sharded,
    shard,
    shard_bounds,
    tokens_view,
)
from offloadkit.models.blocks import attention_module, find_blocks
from offloadkit.models.forwards import ForwardWraps
from offloadkit.models.heads import unwrap_model
from offloadkit.runtime.recompute import output_hooked, recomputing

__all__ = ["apply_tiled_mlp", "tiled_forward", "auto_num_shards", "TiledMLP", "SHARD_ELEMENTS", "OUTPUT_ONLY_ADDED"]

SHARD_ELEMENTS = 2**28
_MARK = "_offloadkit_tiled_mlp"
# Decoder layers whose forward ends ``residual + self.mlp(norm(h))`` and returns: between the
# MLP and the layer's output nothing saves a tensor, so a recompute of the layer that only
# harvests saved tensors never reads the MLP's output. Checked against each class's source in
# transformers.
OUTPUT_ONLY_ADDED = frozenset(
    {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "GemmaDecoderLayer"}
)


def auto_num_shards(tokens: int, width: int) -> int:
    """Shards so that one shard's ``tokens x width`` tensor has at most 2**28 elements."""
    return max(1, math.ceil(tokens * width / SHARD_ELEMENTS))


class TiledMLP(torch.autograd.Function):
    """``TiledMLP.apply(fn, num_shards, n_inputs, prenorm, *inputs, *params)``: ``fn(*inputs)``
    computed over token shards (every input sharded along its token dimension), with
    gradients for the floating-point inputs and for ``params`` (the trainable parameters
    ``fn`` uses). Prefer :func:`tiled_forward`.

    With ``prenorm`` (a :class:`Prenorm`; one input, followed by the norm's input), the
    single input is that norm's output: the norm's input is saved in its place and the
    input's shards are rebuilt from it in backward."""

    @staticmethod
    def forward(ctx, fn, num_shards, n_inputs, prenorm, *tensors):
        inputs = tensors[:n_inputs]
        saved = (tensors[n_inputs],) if prenorm is not None else inputs
        params = tensors[n_inputs + len(saved) :] if prenorm is not None else tensors[n_inputs:]
        bounds = shard_bounds(tokens_view(inputs[0]).shape[-2], abs(num_shards))
        ctx.fn, ctx.bounds, ctx.params, ctx.n_inputs, ctx.prenorm = fn, bounds, params, n_inputs, prenorm
        ctx.input_meta = [(t.shape, t.dtype) for t in inputs]
        ctx.recorded = Recorded(inputs[0].device)
        ctx.save_for_backward(*saved)
        if num_shards < 0:
            # A recompute that only wants the saved input (see OUTPUT_ONLY_ADDED): the output,
            # as wide as the input, is never read.
            ctx.mutates = False
            return inputs[0].new_empty(inputs[0].shape)
        out, ctx.mutates = run_sharded(fn, inputs, bounds)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        params, n_inputs = ctx.params, ctx.n_inputs
        need_in = ctx.needs_input_grad[4 : 4 + n_inputs]
        need_p = ctx.needs_input_grad[4 + n_inputs + (1 if ctx.prenorm is not None else 0) :]
        wanted = [p for p, need in zip(params, need_p) if need]
        device = saved[0].device
        if ctx.prenorm is not None:
            rebuilt = PrenormRows(ctx.prenorm, saved[0])
            shard_inputs = lambda start, n: [rebuilt.rows(start, n)]  # noqa: E731
        else:
            flat = [tokens_view(t) for t in saved]
            shard_inputs = lambda start, n: [shard(t, start, n) for t in flat]  # noqa: E731
        grad_flat = tokens_view(grad_out)
        grad_in = [
            torch.empty(shape, dtype=dtype, device=device) if need else None
            for (shape, dtype), need in zip(ctx.input_meta, need_in)
        ]
        grad_in_flat = [None if g is None else tokens_view(g) for g in grad_in]
        acc: list[torch.Tensor | None] = [None] * len(wanted)
        # Saved-tensor hooks of an enclosing offloading context must not move the shard's
        # tensors: they are used right here.
        with (
            ctx.recorded.replay(),
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
            torch.enable_grad(),
        ):
            for start, n in ctx.bounds:
                leaves = [t.detach().requires_grad_(need) for t, need in zip(shard_inputs(start, n), need_in)]
                # A module that writes its input in place gets a copy: in-place writes to a
                # leaf that requires grad are refused, and the saved input must stay as it came.
                ys = ctx.fn(*[leaf.clone() for leaf in leaves] if ctx.mutates else leaves)
                grad_leaves = [leaf for leaf, need in zip(leaves, need_in) if need]
                targets = grad_leaves + wanted
                grads = [None] * len(targets)
                if ys.requires_grad:
                    grads = list(torch.autograd.grad(ys, targets, shard(grad_flat, start, n), allow_unused=True))
                del ys, leaves, grad_leaves
                for buf, need in zip(grad_in_flat, need_in):
                    if not need:
                        continue
                    gx = grads.pop(0)
                    target = shard(buf, start, n)
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
        if ctx.prenorm is not None:
            rebuilt.release()
        del grad_in_flat
        out_p = iter(None if a is None else a.to(p.dtype) for a, p in zip(acc, wanted))
        grads_p = [next(out_p) if need else None for need in need_p]
        extra = (None,) if ctx.prenorm is not None else ()
        return (None, None, None, None, *grad_in, *extra, *grads_p)


def tiled_forward(fn: Callable, x, num_shards: int, params=None) -> torch.Tensor:
    """``fn(x)`` over ``num_shards`` shards of the tokens (``x.shape[:-1]``, the sequence
    of every batch row in turn), holding one shard's intermediates at a time in forward
    and in backward.

    Args:
        fn: a token-wise function, e.g. ``mlp.forward``.
        x: ``[..., S, H]``; or a tuple of tensors sharded together, each ``[tokens, ...]``
            (an MoE experts module's hidden states, expert indices and routing weights).
        num_shards: shards of the tokens (at most their number).
        params: the trainable tensors ``fn`` uses (default: none); they get gradients.

    Example:
        >>> y = tiled_forward(model.model.layers[0].mlp.forward, x, 8,
        ...                   [p for p in model.model.layers[0].mlp.parameters() if p.requires_grad])
    """
    inputs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    params = tuple(params or ())
    if torch.is_grad_enabled() and (any(t.requires_grad for t in inputs) or any(p.requires_grad for p in params)):
        return TiledMLP.apply(fn, num_shards, len(inputs), None, *inputs, *params)
    bounds = shard_bounds(tokens_view(inputs[0]).shape[-2], num_shards)
    return run_sharded(fn, inputs, bounds)[0]


def _width(module: nn.Module) -> int | None:
    """The widest feature dimension of the module's linear layers (inputs too: a LoRA
    projection's fp32 input copy is as wide as its input)."""
    widths: list[int] = [
        getattr(m, attr)
        for m in module.modules()
        for attr in ("in_features", "out_features")
        if isinstance(getattr(m, attr, None), int)
    ]
    return max(widths) if widths else None


def _experts_width(block: nn.Module, experts: nn.Module) -> int | None:
    """What one token costs an experts module, in elements: each of its ``top_k`` experts
    holds an intermediate as wide as the widest expert weight."""
    widths = [max(p.shape[-2:]) for p in experts.parameters() if p.dim() >= 2]
    top_k = None
    for owner in (block, getattr(block, "gate", None), getattr(block, "router", None)):
        top_k = top_k or getattr(owner, "top_k", None)
    if not isinstance(top_k, int):
        config = getattr(block, "config", None)
        top_k = getattr(config, "num_experts_per_tok", 1)
    width = max(widths) if widths else _width(experts)
    return None if width is None else width * max(1, int(top_k or 1))


def _is_moe(module: nn.Module) -> bool:
    """An MoE block: a router and an ``experts`` module (Mixtral, Qwen2/3-MoE, gpt-oss, ...)."""
    return isinstance(getattr(module, "experts", None), nn.Module)


def _moe_parts(name: str, block: nn.Module) -> list[tuple[str, nn.Module, int | None]]:
    """What of an MoE block runs tiled: its experts (hidden states, expert indices and
    routing weights sharded together) and any shared expert. The router stays outside, so
    its logits and the auxiliary loss built from them keep their graph."""
    experts = block.experts
    assert isinstance(experts, nn.Module)
    parts: list[tuple[str, nn.Module, int | None]] = [(f"{name}.experts", experts, _experts_width(block, experts))]
    for attr in ("shared_expert", "shared_experts", "shared_mlp"):
        child = getattr(block, attr, None)
        if isinstance(child, nn.Module):
            parts.append((f"{name}.{attr}", child, _width(child)))
    return parts


class TiledMLPHandle:
    """What :func:`apply_tiled_mlp` attached; ``remove()`` restores every module's forward.

    Attributes:
        modules: ``(qualified name, module)`` pairs that run tiled.
        num_shards: the fixed shard count, or None for automatic.
    """

    def __init__(self, modules, num_shards, widths=None, output_unread_in_recompute=()):
        self.modules = modules
        # Norms (modules named ``*norm``): a tiled module fed by one saves the norm's input.
        self._norms = {id(m) for name, m in modules if name.rsplit(".", 1)[-1].lower().endswith("norm")}
        self.rebuilt_inputs = 0  # tiled calls that saved a norm's input instead of their own
        self.num_shards = num_shards
        self._widths = widths or {}
        # ``(module, layer)`` pairs: modules whose output nothing reads in a recompute of their
        # layer's forward (MLPs of OUTPUT_ONLY_ADDED layers), by id -> that layer.
        self._unread = {id(m): layer for m, layer in output_unread_in_recompute}
        self.skipped_recomputes = 0  # tiled calls whose shards a recompute skipped
        self._wraps = ForwardWraps(_MARK)

    def _attach(self) -> None:
        def tiled_forward(name: str, module: nn.Module):
            width = self._widths.get(name, _width(module))
            return functools.partial(self._call, module, module.forward, width, self.num_shards)

        self._wraps.wrap_all(self.modules, tiled_forward, "is already tiled by offloadkit")

    def remove(self) -> None:
        """Restore every module's forward."""
        self._wraps.remove()

    def shards_for(self, x: torch.Tensor, width: int | None, fixed: int | None = None) -> int:
        tokens = x.numel() // x.shape[-1]
        if fixed is not None:
            return min(fixed, tokens)
        return min(auto_num_shards(tokens, width or x.shape[-1]), tokens)

    @staticmethod
    def _tileable(args, kwargs) -> bool:
        """One ``[..., S, H]`` tensor, or several 2-D tensors over the same tokens (an
        experts module's hidden states, indices and weights)."""
        if kwargs or not args or not all(torch.is_tensor(a) for a in args):
            return False
        if len(args) == 1:
            return args[0].dim() >= 2
        return all(a.dim() == 2 and a.shape[0] == args[0].shape[0] for a in args)

    def _output_unread(self, module: nn.Module) -> bool:
        """Whether nothing will read ``module``'s output from this call: a recompute of exactly
        its layer's forward (inside a larger unit the next layer reads it), with no forward hook
        to see it. The layer's own hooks do not run in its recompute: the checkpoint wraps the
        layer's forward, inside its hooks."""
        layer = self._unread.get(id(module))
        return layer is not None and recomputing(layer) and not output_hooked(module)

    def _call(self, module: nn.Module, original: Callable, width: int | None, fixed: int | None, *args, **kwargs):
        if not self._tileable(args, kwargs):
            return original(*args, **kwargs)
        shards = self.shards_for(args[0], width, fixed)
        if shards <= 1 and fixed is None:
            return original(*args)
        params = [p for p in module.parameters() if p.requires_grad]
        graph = len(args) == 1 and torch.is_grad_enabled() and not torch.compiler.is_compiling()
        if graph and id(module) in self._norms:
            # Remember how this output was made: a tiled module it feeds saves the norm's
            # input (which the norm saves anyway) instead of this output.
            # Marked also where the norm itself builds no graph (a frozen input): a LoRA
            # projection it feeds still saves its input.
            y = tiled_forward(original, args, shards, params)
            Prenorm(original, shard_bounds(tokens_view(args[0]).shape[-2], shards)).mark(y, args[0])
            return y
        tag = Prenorm.of(args[0]) if graph else None
        skip = graph and self._output_unread(module)
        if skip:
            self.skipped_recomputes += 1
        if tag is not None:
            pre, source = tag
            self.rebuilt_inputs += 1
            return TiledMLP.apply(original, -shards if skip else shards, 1, pre, args[0], source, *params)
        if skip:
            return TiledMLP.apply(original, -shards, 1, None, args[0], *params)
        return tiled_forward(original, args, shards, params)


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
    found = attention_module(block)
    if found is not None:
        attr, attn = found
        parts += [(f"{name}.{attr}.{n}", m) for n, m in attn.named_children() if _linear_like(m)]
    return parts


def _final_norm_parts(base: nn.Module, blocks) -> list[tuple[str, nn.Module]]:
    """The norm after the decoder layers: a direct child named ``*norm`` of the module that
    holds the layers' list (Llama's ``model.norm``). Tiled, it saves its bf16 input instead of
    the fp32 upcast, and its backward holds one shard's fp32 temporaries, not the sequence's."""
    if not blocks:
        return []
    container = blocks[0][0].rsplit(".", 2)[0] if blocks[0][0].count(".") >= 2 else ""
    parent = base.get_submodule(container) if container else base
    prefix = f"{container}." if container else ""
    return [(f"{prefix}{n}", m) for n, m in parent.named_children() if n.lower().endswith("norm")]


def apply_tiled_mlp(
    model: nn.Module,
    num_shards: int | str | None = None,
    predicate: Callable[[str, nn.Module], bool] | None = None,
    projections: bool = False,
) -> TiledMLPHandle:
    """Run the MLP of every decoder layer (``layer.mlp``) over sequence shards.

    Each module's ``forward`` is replaced on the instance (no class is patched); modules
    called with anything but one ``[..., S, H]`` tensor run as before. For an MoE block
    (Mixtral, Qwen2/3-MoE, gpt-oss: a router and an ``experts`` module) the experts and any
    shared expert run tiled and the router runs whole, so the router's logits, and the
    auxiliary loss built from them, keep their gradient.

    Args:
        model: a Hugging Face model (PEFT and other wrappers are looked through) or any
            model whose blocks have an ``mlp``.
        num_shards: shards per call; None or "auto": ``ceil(tokens * width / 2**28)`` for
            each module's width, untiled when that is 1.
        predicate: ``predicate(name, module) -> bool`` choosing the modules instead, e.g.
            ``lambda n, m: n.endswith(("mlp", "layernorm"))`` to tile the norms' fp32
            upcasts too. Chosen modules must be token-wise.
        projections: also tile each layer's norms and attention projections (q/k/v/o with
            their adapters), and the norm after the layers; with automatic shards they run
            untiled below ``2**28 / hidden`` tokens (64K for hidden 4096), so short sequences
            pay nothing.

    Returns:
        A :class:`TiledMLPHandle`; ``handle.remove()`` restores the modules.

    Example:
        >>> handle = apply_tiled_mlp(model, num_shards="auto")
        >>> model(input_ids, labels=labels).loss.backward()
        >>> handle.remove()
    """
    shards = _parse_shards(num_shards)
    base = unwrap_model(model)
    widths: dict[str, int | None] = {}
    if predicate is not None:
        modules = [(n, m) for n, m in base.named_modules() if n and predicate(n, m)]
        how = "the predicate"
        moe = [n for n, m in modules if _is_moe(m)]
        if moe:
            raise ValueError(
                f"{moe[0]} is an MoE block: tiled whole, its router would run inside the tiled "
                "function, where the auxiliary loss's gradient cannot reach it; choose its experts "
                f"instead ({moe[0]}.experts), as the default selection does"
            )
    else:
        modules = []
        unread = []
        for name, block in find_blocks(base):
            mlp = getattr(block, "mlp", None) or getattr(block, "block_sparse_moe", None)
            if not isinstance(mlp, nn.Module):
                continue
            mlp_name = f"{name}.mlp" if getattr(block, "mlp", None) is mlp else f"{name}.block_sparse_moe"
            if _is_moe(mlp):
                for part_name, part, width in _moe_parts(mlp_name, mlp):
                    modules.append((part_name, part))
                    widths[part_name] = width
            else:
                modules.append((mlp_name, mlp))
                if type(block).__name__ in OUTPUT_ONLY_ADDED and getattr(block, "mlp", None) is mlp:
                    unread.append((mlp, block))
        how = "layer.mlp of the decoder layers"
    if projections:
        blocks = find_blocks(base)
        for name, block in blocks:
            modules += _projection_parts(name, block)
        modules += _final_norm_parts(base, blocks)
    if not modules:
        raise ValueError(
            f"no modules to tile in {type(base).__name__} by {how}; choose them with predicate=lambda name, module: ..."
        )
    attn = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if attn == "eager":
        warnings.warn(
            "offloadkit: attention is 'eager', which builds [batch, heads, seq, seq] scores; at the "
            "lengths tiled_mlp is for, load the model with attn_implementation='sdpa' or "
            "'flash_attention_2'",
            UserWarning,
            stacklevel=2,
        )
    handle = TiledMLPHandle(modules, shards, widths, unread if predicate is None else ())
    handle._attach()
    return handle
