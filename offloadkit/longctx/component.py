"""The long-context parts as :func:`~offloadkit.prepare` builds them: the chunked loss, the tiled
MLP and attention over head groups, each wrapping modules before checkpointing wraps the blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from offloadkit.component import Component
from offloadkit.longctx.attention_groups import AttentionHeadGroups, apply_attention_head_groups
from offloadkit.longctx.causal_lm import ChunkedLossHandle, apply_chunked_loss
from offloadkit.longctx.options import LongContextOptions
from offloadkit.longctx.tiled_mlp import TiledMLPHandle, apply_tiled_mlp

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = ["CHUNKED_LOSS", "HEAD_GROUPS", "TILED_MLP"]


def build_chunked_loss(model: nn.Module, options: LongContextOptions, run: OffloadRuntime) -> ChunkedLossHandle | None:
    if not options.chunked_loss:
        return None
    try:
        return apply_chunked_loss(model, options.loss_chunks)
    except ValueError as exc:
        run.note(f"chunked_cross_entropy has no effect: {exc}")
        return None


def build_tiled_mlp(model: nn.Module, options: LongContextOptions, run: OffloadRuntime) -> TiledMLPHandle | None:
    if not options.tiled_mlp:
        return None
    try:
        return apply_tiled_mlp(model, options.mlp_shards, projections=options.tiled_projections)
    except ValueError as exc:
        run.note(f"tiled_mlp has no effect: {exc}")
        return None


def build_head_groups(model: nn.Module, options: LongContextOptions, run: OffloadRuntime) -> AttentionHeadGroups | None:
    if not options.head_groups:
        return None
    try:
        return apply_attention_head_groups(model, options.head_groups)
    except ValueError as exc:
        run.note(f"attention_head_groups has no effect: {exc}")
        return None


CHUNKED_LOSS = Component(
    name="chunked_loss",
    options=LongContextOptions,
    why_here="first: it replaces the model's loss, which the step timeline's head hooks then see as the forward's tail",
    build=build_chunked_loss,
)
TILED_MLP = Component(
    name="tiled_mlp",
    options=LongContextOptions,
    why_here="wraps MLP modules inside the blocks, before checkpointing wraps the blocks around them",
    build=build_tiled_mlp,
)
HEAD_GROUPS = Component(
    name="head_groups",
    options=LongContextOptions,
    why_here="wraps each layer's attention inside the blocks before checkpointing: recomputes see plain kernel calls",
    build=build_head_groups,
)
