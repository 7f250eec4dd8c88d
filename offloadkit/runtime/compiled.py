"""Whether a module runs as one ``torch.compile`` graph (private attributes read here only)."""

from __future__ import annotations

from torch import nn

__all__ = ["compiled_as_a_whole", "WHOLE_MODEL_COMPILE_NOTE"]

WHOLE_MODEL_COMPILE_NOTE = (
    "the model is compiled as a whole (torch.compile(model) or model.compile()): PyTorch runs the saved-tensor "
    "hooks of a compiled graph for all its saved tensors at the start of its backward, so offloading them "
    "cannot lower the GPU peak; compile each decoder layer instead (for layer in model.model.layers: "
    "layer.compile()), which offloadkit follows layer by layer")


def compiled_as_a_whole(model: nn.Module) -> bool:
    """True for ``torch.compile(model)`` (an ``OptimizedModule``) or after ``model.compile()``."""
    if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return True
    return getattr(model, "_compiled_call_impl", None) is not None
