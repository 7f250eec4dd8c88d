"""Layer streaming (``layer_offloading``): block weights (a LoRA model's frozen base, or a full
fine-tune's trainable weights updated in backward) in pinned host memory, visiting the GPU one
layer at a time."""

from offloadkit.layers.apply import apply_layer_streaming
from offloadkit.layers.flat import FlatWeights
from offloadkit.layers.stats import StreamStats
from offloadkit.layers.streaming import LayerStreamer

__all__ = ["FlatWeights", "LayerStreamer", "StreamStats", "apply_layer_streaming"]
