"""The frozen input embedding table in host memory, as :func:`~offloadkit.prepare` builds it,
and what it takes off a step's GPU bytes and puts in host RAM."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from offloadkit.component import Component, Footprint, FootprintOptions
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.embeddings.host_table import HostEmbeddings, offload_embeddings, refusal
from offloadkit.embeddings.options import EmbeddingOptions

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = ["EMBEDDINGS", "effective_embeddings", "embeddings_footprint"]


def build_embeddings(model: nn.Module, options: EmbeddingOptions, run: OffloadRuntime) -> HostEmbeddings | None:
    if not options.offload:
        return None
    try:
        return offload_embeddings(model)
    except ValueError as exc:
        run.note(f"{options.key('offload')} has no effect: {exc}")
        return None


def effective_embeddings(model: nn.Module, options: EmbeddingOptions) -> EmbeddingOptions:
    """Off where the build would refuse this model's table (it trains, the head shares it, it is
    not a plain tensor on a GPU): the planner then counts it on the GPU."""
    return options if not options.offload or refusal(model) is None else EmbeddingOptions(offload=False)


def report_embeddings(handle: HostEmbeddings) -> dict:
    return {"embedding_offloading": {"host_bytes": handle.nbytes}}


def embeddings_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """The table's bytes move from the GPU's weights to pinned host RAM: a LoRA model's frozen
    table only, not one the output head shares nor one FSDP2 shards (the build refuses both)."""
    if not (f.of(EmbeddingOptions).offload and w.lora_rank) or w.shape.tied or w.parallel.weight_shards > 1:
        return Footprint()
    table = w.shape.embed_params * w.dtype_bytes
    return Footprint(gpu={"input embeddings in host memory": -table}, host={"input embeddings": table})


EMBEDDINGS = Component(
    name="embeddings",
    options=EmbeddingOptions,
    why_here="moves one weight no other component wraps; last, once every other feature is attached",
    build=build_embeddings,
    report=report_embeddings,
    footprint=embeddings_footprint,
    effective=effective_embeddings,
)
