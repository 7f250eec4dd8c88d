"""Activation checkpointing of repeated blocks, selective policies, and block-input offloading."""

from offloadkit.checkpointing.apply import (
    CheckpointedBlocks,
    apply_activation_checkpointing,
)
from offloadkit.checkpointing.selective import OP_GROUPS, selective_context_fn

__all__ = ["OP_GROUPS", "CheckpointedBlocks", "apply_activation_checkpointing", "selective_context_fn"]
