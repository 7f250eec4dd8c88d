"""Liger's fused norm and gated-MLP kernels as :func:`~offloadkit.prepare` builds them, and what
they take off a step's saved bytes."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from torch import nn

from offloadkit.component import Component, Footprint, FootprintOptions
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.kernels.attention import AttentionKernel, apply_attention_kernel, attention_kernel_unusable
from offloadkit.kernels.liger import LigerKernels, applicable, apply_liger_kernels, liger_unusable
from offloadkit.kernels.options import AttentionKernelOptions, KernelOptions
from offloadkit.longctx.footprint import (
    NORM_BACKWARD_FP32,
    mlp_backward_bytes_per_token,
    projections_tiled,
    tiled_mlp_shards,
)

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = [
    "ATTENTION_KERNEL",
    "KERNELS",
    "auto_kernels",
    "effective_kernels",
    "kernels_footprint",
    "kernels_unusable",
    "llama_auto_kernels",
]

_KINDS = ("rms_norm", "glu_activation")


def kernels_unusable(model: nn.Module) -> dict[str, str | None]:
    """Per option (``rms_norm``, ``glu_activation``), why its kernel cannot run on ``model``
    here (None: it can)."""
    why = liger_unusable()
    norms, mlps = applicable(model)
    return {
        "rms_norm": why or (None if norms else "the model has no RMSNorm of a class the kernel reproduces"),
        "glu_activation": why or (None if mlps else "the model has no SiLU-gated MLP of a class the kernel reproduces"),
    }


def llama_auto_kernels() -> tuple[KernelOptions, ...]:
    """The kernels ``offload_plan: auto`` would run on a Llama-family model in this process
    (both, where liger-kernel and a GPU are here): for planning a shape without a model."""
    return () if liger_unusable() is not None else (KernelOptions(rms_norm=True, glu_activation=True),)


def build_kernels(model: nn.Module, options: KernelOptions, run: OffloadRuntime) -> LigerKernels | None:
    asked = [n for n in _KINDS if getattr(options, n)]
    if not asked:
        return None
    why = kernels_unusable(model)
    for reason in dict.fromkeys(why[n] for n in asked if why[n] is not None):
        keys = " and ".join(options.key(n) for n in asked if why[n] == reason)
        run.note(f"{keys} has no effect: {reason}")
    runs = {n: n in asked and why[n] is None for n in _KINDS}
    if not any(runs.values()):
        return None
    try:
        handle = apply_liger_kernels(model, **runs)
    except ValueError as exc:
        keys = " and ".join(options.key(n) for n in _KINDS if runs[n])
        run.note(f"{keys} has no effect: {exc}")
        return None
    for name, reason in handle.skipped.items():
        run.note(f"{options.key('glu_activation')}: {name} stays eager ({reason})")
    return handle


def report_kernels(handle: LigerKernels) -> dict:
    return {"liger_kernels": {"rms_norms": len(handle.norms), "gated_mlps": len(handle.mlps)}}


def effective_kernels(model: nn.Module, options: KernelOptions) -> KernelOptions:
    """Each kernel off where the build would leave the model eager: the planner then counts
    eager saves."""
    if not (options.rms_norm or options.glu_activation):
        return options
    why = kernels_unusable(model)
    return dataclasses.replace(options, **{n: False for n in _KINDS if getattr(options, n) and why[n] is not None})


def auto_kernels(model: nn.Module, options: KernelOptions) -> KernelOptions:
    """What ``offload_plan: auto`` runs: each kernel left unset, on where it runs on ``model``."""
    why = kernels_unusable(model)
    return dataclasses.replace(options, **{n: True for n in _KINDS if getattr(options, n) is None and why[n] is None})


def kernels_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """Per token of a layer, with the norms untiled: the post-attention norm saves its 16-bit
    input instead of an fp32 copy (the input norm's is the block input, counted apart; a full
    fine-tune's norms no longer save their normalised value), and the input norm's backward
    makes one 16-bit input gradient where the eager one holds fp32 temporaries (attention's
    side of the layer's backward then counts two 16-bit ``[S, H]`` gradients, as with tiled
    norms). The gated MLP saves no SiLU output (untiled) or rebuilds none (a tiled shard), and
    its backward writes the gate's and up's gradients over their saved outputs: only the
    product's gradient is new, where the eager backward holds four intermediate-wide
    tensors' bytes. The final norm, untiled, saves its 16-bit input, an fp32 scale a token and
    the head's input during the loss phase. Tiled norms save their input either way."""
    k = f.of(KernelOptions)
    s, t, b = w.shape, w.tokens, w.dtype_bytes
    h, i = s.hidden, s.intermediate
    layer = mlp_backward = attention_backward = 0
    loss = {}
    if k.rms_norm is True and not projections_tiled(f):
        eager = 2 * 4 * h + (0 if w.lora_rank else 2 * b * h)  # fp32 inputs (+ the normed values)
        layer += t * (b * h - eager)
        attention_backward = t * (2 * b * h - NORM_BACKWARD_FP32 * 4 * h)
    if k.rms_norm is True and not (projections_tiled(f) and tiled_mlp_shards(f) > 1):  # the final norm untiled
        loss["final norm"] = t * (2 * b * h + 4)  # replaces the eager count of that name
    if k.glu_activation is True:
        shards = tiled_mlp_shards(f)
        rows = -(-t // shards)  # one shard's tokens (all of them untiled)
        mlp_backward = -rows * (mlp_backward_bytes_per_token(w) - b * i)
        if shards > 1:
            mlp_backward -= rows * b * i
        elif not projections_tiled(f):
            layer -= t * b * i
    if not (layer or mlp_backward or attention_backward or loss):
        return Footprint()
    return Footprint(layer_saved=layer, mlp_backward=mlp_backward, attention_backward=attention_backward, loss=loss)


KERNELS = Component(
    name="kernels",
    options=KernelOptions,
    why_here="gives norms and gated MLPs their fused forward before the tiled MLP and projections run them by shards",
    build=build_kernels,
    report=report_kernels,
    footprint=kernels_footprint,
    effective=effective_kernels,
)


def build_attention_kernel(model: nn.Module, options: AttentionKernelOptions, run: OffloadRuntime):
    if options.kernel == "auto":
        return None
    why = attention_kernel_unusable(options.kernel, model)
    if why is not None:
        run.note(f"{options.key('kernel')}: {options.kernel} has no effect: {why}")
        return None
    try:
        return apply_attention_kernel(model, options.kernel)
    except (ImportError, RuntimeError) as exc:  # a provider whose imports fail, or that lacks its kernels
        run.note(f"{options.key('kernel')}: {options.kernel} has no effect: {type(exc).__name__}: {exc}")
        return None


def report_attention_kernel(handle: AttentionKernel) -> dict:
    return {"attention_kernel": {"kernel": handle.kernel, "attention_modules": len(handle.modules)}}


def attention_kernel_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """Nothing beyond the planner's own attention count: every kernel saves the attention
    output and its log-sum-exp for backward, and the backward's workspace the planner counts is
    cuDNN's (an fp32 copy of the query gradient, and more), which the flash kernels' fp32 query
    gradient accumulator does not exceed."""
    return Footprint()


ATTENTION_KERNEL = Component(
    name="attention_kernel",
    options=AttentionKernelOptions,
    why_here=(
        "wraps each attention module's forward, so its recompute under checkpointing runs the kernel the forward ran"
    ),
    build=build_attention_kernel,
    report=report_attention_kernel,
    footprint=attention_kernel_footprint,
)
