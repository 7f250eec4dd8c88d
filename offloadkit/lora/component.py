"""The fused LoRA path as :func:`~offloadkit.prepare` builds it, and what it changes in a step's
footprint: each adapted projection saves its 16-bit input (shared by the projections that read
it) and its rank-r activation instead of an fp32 copy of its input per adapter."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from offloadkit.component import Component, Footprint, FootprintOptions
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.longctx.footprint import projections_tiled, tiled_mlp_shards
from offloadkit.lora.fused import FusedLoRA, apply_fused_lora
from offloadkit.lora.options import LoraOptions

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = ["FUSED_LORA", "fused_lora_footprint"]


def build_fused_lora(model: nn.Module, options: LoraOptions, run: OffloadRuntime) -> FusedLoRA | None:
    if not options.fused:
        return None
    try:
        names = options.fused if isinstance(options.fused, list) else None
        handle = apply_fused_lora(model, names)
    except ValueError as exc:
        run.note(f"{options.key('fused')} has no effect: {exc}")
        return None
    if handle.skipped and not handle.layers:
        kinds = sorted(set(handle.skipped.values()))
        run.note(f"{options.key('fused')} has no effect: no LoRA layer has a plain nn.Linear base ({'; '.join(kinds)})")
    return handle


def report_fused_lora(handle: FusedLoRA) -> dict:
    return {"fused_lora": {"layers": len(handle.layers), "unfused": len(handle.skipped)}}


def fused_lora_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """Per token of a layer: attention's adapters save the shared 16-bit norm output and four
    rank-r activations instead of fp32 copies of q/k/v's input (three) and o's (as wide as q);
    an untiled MLP's save the shared norm output, the down projection's 16-bit input and three
    rank-r activations instead of fp32 copies of gate's and up's inputs and down's; a tiled MLP's
    shard holds the same set for its tokens in backward. With the projections tiled too, their
    adapters save nothing of their own either way."""
    if not (f.of(LoraOptions).fused is True and w.lora_rank) or projections_tiled(f):
        return Footprint()
    s, t, b, a, r = w.shape, w.tokens, w.dtype_bytes, w.adapter_bytes, w.lora_rank
    h, i, q = s.hidden, s.intermediate, s.heads * s.head_dim
    attention = (b * h + 4 * b * r) - (a * (3 * h + q) + 4 * a * r)
    mlp = (b * h + b * i + 3 * b * r) - (a * (2 * h + i) + 3 * a * r)
    shards = tiled_mlp_shards(f)
    if shards > 1:
        shard = -(-t // shards)
        return Footprint(layer_saved=t * attention, mlp_backward=shard * (b * h + b * i - a * (2 * h + i)))
    return Footprint(layer_saved=t * (attention + mlp))


FUSED_LORA = Component(
    name="fused_lora",
    options=LoraOptions,
    why_here="gives the adapted projections a forward before the tiled projections and checkpointing wrap them",
    build=build_fused_lora,
    report=report_fused_lora,
    footprint=fused_lora_footprint,
)
