"""Whether a module runs as one ``torch.compile`` graph (private attributes read here only)."""

from __future__ import annotations

from torch import nn

__all__ = ["compiled_as_a_whole", "WHOLE_MODEL_COMPILE_NOTE"]

WHOLE_MODEL_COMPILE_NOTE = (
    "the model is compiled as a whole (torch.compile(model) or model.compile()): PyTorch runs the saved-tensor "
    "hooks of a compiled graph for all its saved tensors at once, at the end of its forward and the start of its "
    "backward, so offloading everything brings all of them back together, and the model recompiles at every "
    "step (measured 385x slower on an H100); use checkpoint-input offload instead (gradient_checkpointing with "
    "activation_offloading, or apply_activation_checkpointing(model, offload_inputs=True)), whose checkpoints run "
    "eagerly between the compiled parts, or compile each decoder layer (layer.compile())"
)


def compiled_as_a_whole(model: nn.Module) -> bool:
    """True for ``torch.compile(model)`` (an ``OptimizedModule``) or after ``model.compile()``."""
    if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return True
    return getattr(model, "_compiled_call_impl", None) is not None
