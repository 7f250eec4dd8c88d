"""What layer streaming costs in one step, beside its code: the GPU holds the embeddings, the
head and ``depth`` decoder layers' weights at a time (a replayed run of checkpointed blocks
holds its blocks resident together), and host RAM holds the pinned copies of every layer."""

from __future__ import annotations

from offloadkit.component import Footprint, FootprintOptions
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.layers.options import StreamingOptions
from offloadkit.optim.options import OptimizerOptions
from offloadkit.storage.footprint import block_placement, region_length

__all__ = ["layer_streaming_footprint", "streams_weights"]


def streams_weights(w: Workload, f: FootprintOptions) -> bool:
    """Whether the layers' weights stream from host memory: a LoRA model's frozen base, or a
    full fine-tune's trainable weights when the optimizer updates them in backward."""
    return f.of(StreamingOptions).enabled and (bool(w.lora_rank) or f.of(OptimizerOptions).enabled)


def layer_streaming_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """The weights resident on the GPU (they replace the whole model's) and the pinned host
    copies of the streamed layers."""
    if not streams_weights(w, f):
        return Footprint()
    s, b = w.shape, w.dtype_bytes
    edge = (s.embed_params + s.head_params + s.hidden) * b
    replayed = region_length(block_placement(s.layers, f))
    resident = min(max(f.of(StreamingOptions).depth, replayed), s.layers)
    return Footprint(
        gpu={"weights": edge + resident * s.layer_params * b},
        host={"streamed layers": s.layers * s.layer_params * b},
    )
