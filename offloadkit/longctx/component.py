"""The long-context parts as :func:`~offloadkit.prepare` builds them: the chunked loss, the tiled
MLP and attention over head groups, each wrapping modules before checkpointing wraps the blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from offloadkit.component import Component
from offloadkit.longctx.attention_groups import AttentionHeadGroups, apply_attention_head_groups
from offloadkit.longctx.causal_lm import ChunkedLossHandle, apply_chunked_loss
from offloadkit.longctx.footprint import chunked_loss_footprint, head_groups_footprint, tiled_mlp_footprint
from offloadkit.longctx.options import LongContextOptions
from offloadkit.longctx.tiled_mlp import TiledMLPHandle, apply_tiled_mlp

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = ["CHUNKED_LOSS", "HEAD_GROUPS", "TILED_MLP"]


def _attached(run: OffloadRuntime, key: str, attach: Callable[[], Any]) -> Any:
    """``attach()``, or None with one note naming ``key`` where the model offers it nothing."""
    try:
        return attach()
    except ValueError as exc:
        run.note(f"{key} has no effect: {exc}")
        return None


def build_chunked_loss(model: nn.Module, options: LongContextOptions, run: OffloadRuntime) -> ChunkedLossHandle | None:
    if not options.chunked_loss:
        return None
    return _attached(run, options.key("chunked_loss"), lambda: apply_chunked_loss(model, options.loss_chunks))


def build_tiled_mlp(model: nn.Module, options: LongContextOptions, run: OffloadRuntime) -> TiledMLPHandle | None:
    if not options.tiled_mlp:
        return None

    def attach() -> TiledMLPHandle:
        return apply_tiled_mlp(model, options.mlp_shards, projections=options.tiled_projections)

    return _attached(run, options.key("tiled_mlp"), attach)


def build_head_groups(model: nn.Module, options: LongContextOptions, run: OffloadRuntime) -> AttentionHeadGroups | None:
    if not options.head_groups:
        return None
    return _attached(run, options.key("head_groups"), lambda: apply_attention_head_groups(model, options.head_groups))


CHUNKED_LOSS = Component(
    name="chunked_loss",
    options=LongContextOptions,
    why_here="first: it replaces the model's loss, which the step timeline's head hooks then see as the forward's tail",
    build=build_chunked_loss,
    footprint=chunked_loss_footprint,
)
TILED_MLP = Component(
    name="tiled_mlp",
    options=LongContextOptions,
    why_here="wraps MLP modules inside the blocks, before checkpointing wraps the blocks around them",
    build=build_tiled_mlp,
    footprint=tiled_mlp_footprint,
)
HEAD_GROUPS = Component(
    name="head_groups",
    options=LongContextOptions,
    why_here="wraps each layer's attention inside the blocks before checkpointing: recomputes see plain kernel calls",
    build=build_head_groups,
    footprint=head_groups_footprint,
)
