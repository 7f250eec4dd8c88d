"""Checkpointing as :func:`~offloadkit.prepare` builds it: every decoder layer checkpointed by
offloadkit, unless Hugging Face's own gradient checkpointing is already on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from offloadkit.checkpointing.apply import CheckpointedBlocks, apply_activation_checkpointing
from offloadkit.checkpointing.footprint import checkpointing_footprint
from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import Component
from offloadkit.models.heads import unwrap_model

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = ["CHECKPOINTING", "hf_checkpointing_on"]

# Fields that act through offloadkit's checkpointing only.
_OWN_FIELDS = ("selective", "recompute_block_inputs", "block_input_placement", "keep_attention")


def hf_checkpointing_on(model: nn.Module) -> bool:
    """Whether a module of ``model`` has Hugging Face's gradient checkpointing on."""
    base = unwrap_model(model)
    return any(getattr(m, "gradient_checkpointing", False) is True for m in base.modules())


def build_checkpointing(model: nn.Module, options: CheckpointOptions, run: OffloadRuntime) -> CheckpointedBlocks | None:
    if not options.enabled:
        return None
    if hf_checkpointing_on(model):
        for name in _OWN_FIELDS:
            if getattr(options, name):
                run.note(
                    f"{options.key(name)} has no effect: Hugging Face gradient checkpointing is already on (turn it "
                    "off to use offloadkit's)"
                )
        return None
    return apply_activation_checkpointing(
        model,
        selective=options.selective,
        keep_last_input=1 + options.gpu_block_inputs,
        recompute_inputs=options.recompute_block_inputs,
        placement=options.block_input_placement or None,
        # Without offloading the config has already said it has no effect.
        keep_attention=options.keep_attention if run.config.activation_offloading else False,
    )


CHECKPOINTING = Component(
    name="checkpointing",
    options=CheckpointOptions,
    why_here="replaces each block's forward before the timeline and the manager exist: they see only its saves",
    build=build_checkpointing,
    footprint=checkpointing_footprint,
)
