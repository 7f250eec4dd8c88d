"""Layer streaming (``layer_offloading``): block weights (a LoRA model's frozen base, or a full
fine-tune's trainable weights updated in backward) in pinned host memory, visiting the GPU one
layer at a time."""

from offloadkit.layers.flat import FlatWeights
from offloadkit.layers.streaming import (
    LayerStreamer,
    StreamStats,
    apply_layer_streaming,
)

__all__ = ["FlatWeights", "LayerStreamer", "StreamStats", "apply_layer_streaming"]
