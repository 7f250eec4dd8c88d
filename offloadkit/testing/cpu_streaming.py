"""Layer streaming on a machine without a GPU, for tests: the streamer's bookkeeping (loads,
evictions, prefetch order, residency, state_dict and PEFT paths) with CPU memory standing in
for device memory."""

from __future__ import annotations

import torch

from offloadkit.layers.streaming import LayerStreamer, build_streamer

__all__ = ["CpuLayerStreamer", "stream_layers_on_cpu"]


class CpuLayerStreamer(LayerStreamer):
    """A :class:`~offloadkit.layers.LayerStreamer` whose "device" is the CPU."""

    def _compute_device(self) -> torch.device:
        return torch.device("cpu")


def stream_layers_on_cpu(model: torch.nn.Module, **kwargs) -> LayerStreamer:
    """:func:`~offloadkit.layers.apply_layer_streaming` with CPU memory as the device."""
    return build_streamer(CpuLayerStreamer, model, **kwargs)
