"""Liger's fused norm and gated-MLP kernels as :func:`~offloadkit.prepare` builds them, and what
they take off a step's saved bytes."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from torch import nn

from offloadkit.component import Component, Footprint, FootprintOptions
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.kernels.liger import GATED_MLPS, NORMS, LigerKernels, apply_liger_kernels, liger_unusable
from offloadkit.kernels.options import KernelOptions
from offloadkit.longctx.footprint import projections_tiled, tiled_mlp_shards

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = ["KERNELS", "effective_kernels", "kernels_footprint", "kernels_unusable"]


def kernels_unusable(model: nn.Module, options: KernelOptions) -> str | None:
    """Why the kernels asked for cannot run on ``model`` here (None: they can)."""
    why = liger_unusable()
    if why is not None:
        return why
    kinds = {type(m).__name__ for m in model.modules()}
    if not ((options.rms_norm and kinds & set(NORMS)) or (options.glu_activation and kinds & GATED_MLPS)):
        return "the model has no RMSNorm or gated MLP of a class the kernels reproduce"
    return None


def build_kernels(model: nn.Module, options: KernelOptions, run: OffloadRuntime) -> LigerKernels | None:
    if not (options.rms_norm or options.glu_activation):
        return None
    keys = " and ".join(options.key(n) for n in ("rms_norm", "glu_activation") if getattr(options, n))
    why = kernels_unusable(model, options)
    if why is not None:
        run.note(f"{keys} has no effect: {why}")
        return None
    handle = apply_liger_kernels(model, rms_norm=bool(options.rms_norm), glu_activation=bool(options.glu_activation))
    for name, reason in handle.skipped.items():
        run.note(f"{options.key('glu_activation')}: {name} stays eager ({reason})")
    return handle


def report_kernels(handle: LigerKernels) -> dict:
    return {"liger_kernels": {"rms_norms": len(handle.norms), "gated_mlps": len(handle.mlps)}}


def effective_kernels(model: nn.Module, options: KernelOptions) -> KernelOptions:
    """Off where the build would leave the model eager: the planner then counts eager saves."""
    if (options.rms_norm or options.glu_activation) and kernels_unusable(model, options) is not None:
        return dataclasses.replace(options, rms_norm=False, glu_activation=False)
    return options


def kernels_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """Per token of a layer, with the norms untiled: the post-attention norm saves its 16-bit
    input instead of an fp32 copy (the input norm's is the block input, counted apart; a full
    fine-tune's norms no longer save their normalised value); the untiled MLP saves
    no SiLU output, a tiled MLP's shard rebuilds none in backward. The final norm, untiled,
    saves its 16-bit input, an fp32 scale a token and the head's input during the loss phase.
    Tiled norms save their input either way."""
    k = f.of(KernelOptions)
    s, t, b = w.shape, w.tokens, w.dtype_bytes
    h, i = s.hidden, s.intermediate
    layer = mlp_backward = 0
    loss = {}
    if k.rms_norm is True and not projections_tiled(f):
        eager = 2 * 4 * h + (0 if w.lora_rank else 2 * b * h)  # fp32 inputs (+ the normed values)
        layer += t * (b * h - eager)
        loss["final norm"] = t * (2 * b * h + 4)  # replaces the eager count of that name
    if k.glu_activation is True:
        shards = tiled_mlp_shards(f)
        if shards > 1:
            mlp_backward = -(-t // shards) * -b * i
        elif not projections_tiled(f):
            layer -= t * b * i
    if not (layer or mlp_backward or loss):
        return Footprint()
    return Footprint(layer_saved=layer, mlp_backward=mlp_backward, loss=loss)


KERNELS = Component(
    name="kernels",
    options=KernelOptions,
    why_here="gives norms and gated MLPs their fused forward before the tiled MLP and projections run them by shards",
    build=build_kernels,
    report=report_kernels,
    footprint=kernels_footprint,
    effective=effective_kernels,
)
