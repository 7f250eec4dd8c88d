"""PEFT helpers (optional dependency)."""

from __future__ import annotations

from torch import nn

from offloadkit.extras import require

__all__ = ["apply_lora", "require_peft"]


def require_peft():
    return require("peft", "hf", "LoRA")


def apply_lora(
    model: nn.Module,
    rank: int = 16,
    alpha: int | None = None,
    target_modules="all-linear",
    dropout: float = 0.0,
    modules_to_save: list | None = None,
    use_dora: bool = False,
) -> nn.Module:
    """Wrap ``model`` with LoRA adapters on every linear layer but the output head.

    Args:
        modules_to_save: modules trained whole next to the adapters (e.g. ``["lm_head"]``).
        use_dora: DoRA adapters (weight-decomposed LoRA).

    Example:
        >>> lora_model = apply_lora(build_llama("tiny"), rank=8)
    """
    if rank < 1:
        raise ValueError(f"lora rank={rank!r} is invalid; pass an int >= 1")
    peft = require_peft()
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=target_modules,
        lora_dropout=dropout,
        modules_to_save=modules_to_save,
        use_dora=use_dora,
    )
    return peft.get_peft_model(model, config)
