"""Layer streaming as :func:`~offloadkit.prepare` builds it: the decoder layers' weights streamed
on the run's step timeline, host budget and prefetch scheduler, loaded ahead of the replays of
the checkpointing built before it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from offloadkit.component import Component
from offloadkit.engine.options import ActivationOptions
from offloadkit.layers.apply import apply_layer_streaming
from offloadkit.layers.footprint import layer_streaming_footprint
from offloadkit.layers.options import StreamingOptions
from offloadkit.layers.streaming import LayerStreamer
from offloadkit.optim.options import OptimizerOptions

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = ["LAYER_STREAMING"]


def build_layer_streaming(model: nn.Module, options: StreamingOptions, run: OffloadRuntime) -> LayerStreamer | None:
    if not options.enabled:
        return None
    if not torch.cuda.is_available():
        run.note("layer_offloading has no effect without a CUDA GPU")
        return None
    try:
        # Trainable weights stream only when the optimizer updates them in backward,
        # while their block is resident; torch's AdamW would step over host memory.
        streamer = apply_layer_streaming(
            model,
            depth=options.depth,
            use_pin_memory=run.config.options(ActivationOptions).use_pin_memory,
            budget=run.handles["host_budget"],
            trainable=run.config.options(OptimizerOptions).enabled,
            scheduler=run.scheduler,
            disk_dir=options.disk_dir,
            timeline=run.step_timeline(),
        )
    except ValueError as exc:
        if "layer streaming found no" not in str(exc):
            raise
        run.note(
            "layer_offloading has no effect: the model's layers hold no frozen weights "
            "(it streams the frozen base of LoRA/QLoRA models, and a full fine-tune's weights "
            "with optimizer_offloading: true)"
        )
        return None
    if run.checkpointing is not None and run.checkpointing.recompute_inputs:
        # A replayed region runs blocks backward has not reached yet: load them first.
        run.checkpointing.register_replay_hook(streamer.make_resident)
    return streamer


def report_layer_streaming(streamer: LayerStreamer) -> dict:
    st = streamer.collect_stats()
    return {
        "layer_streaming": {
            "streamed_bytes": streamer.streamed_bytes,
            "layers": len(streamer.layers),
            "depth": streamer.depth,
            "trainable": streamer.trainable,
            "loads": st.loads,
            "write_backs": st.write_backs,
            "loaded_bytes": st.loaded_bytes,
            "misses": st.misses,
            "max_resident": st.max_resident,
            "wait_seconds": st.wait_seconds,
            "disk_layers": st.disk_layers,
            "disk_bytes": st.disk_bytes,
            "disk_read_bytes": st.disk_read_bytes,
        }
    }


LAYER_STREAMING = Component(
    name="layer_streaming",
    options=StreamingOptions,
    why_here="last: it moves weights earlier steps wrapped in place; subscribed after the manager, which acts first",
    build=build_layer_streaming,
    report=report_layer_streaming,
    footprint=layer_streaming_footprint,
)
