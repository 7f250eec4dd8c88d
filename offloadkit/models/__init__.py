"""Model introspection: unwrapping wrappers (DDP, FSDP, PEFT, torch.compile), finding heads and blocks."""

from offloadkit.models.blocks import find_blocks
from offloadkit.models.heads import find_output_head, unwrap_model

__all__ = ["find_blocks", "find_output_head", "unwrap_model"]
