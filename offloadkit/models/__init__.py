"""Model introspection: unwrapping wrappers (DDP, FSDP, PEFT, torch.compile), finding heads."""

from offloadkit.models.heads import find_output_head, unwrap_model

__all__ = ["find_output_head", "unwrap_model"]
