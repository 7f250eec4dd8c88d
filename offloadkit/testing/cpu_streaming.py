"""Layer streaming on a machine without a GPU, for tests: the streamer's bookkeeping (loads,
evictions, prefetch order, residency, state_dict and PEFT paths) with CPU memory standing in
for device memory."""

from __future__ import annotations

import torch

from offloadkit.layers import LayerStreamer, apply_layer_streaming

__all__ = ["stream_layers_on_cpu"]


def stream_layers_on_cpu(model: torch.nn.Module, **kwargs) -> LayerStreamer:
    """:func:`~offloadkit.layers.apply_layer_streaming` with CPU memory as the device."""
    return apply_layer_streaming(model, device="cpu", **kwargs)
