"""PEFT helpers (optional dependency)."""

from __future__ import annotations

import contextlib

from torch import nn

from offloadkit.extras import require

__all__ = ["apply_lora", "load_lora", "require_peft"]


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
    use_rslora: bool = False,
    fan_in_fan_out: bool = False,
    target_parameters: list | None = None,
) -> nn.Module:
    """Wrap ``model`` with LoRA adapters on every linear layer but the output head.

    Args:
        modules_to_save: modules trained whole next to the adapters (e.g. ``["lm_head"]``).
        use_dora: DoRA adapters (weight-decomposed LoRA).
        use_rslora: rank-stabilised LoRA: the update is scaled by alpha / sqrt(rank)
            instead of alpha / rank.
        fan_in_fan_out: the targeted layers store their weight as (in, out) (GPT-2's Conv1D).
        target_parameters: parameters (not modules) to put LoRA on, by name, e.g. a
            mixture-of-experts layer's ``experts.gate_up_proj``. Such adapters (PEFT's
            ParamWrapper, also what PEFT puts on the fused experts of transformers 5's MoE
            layers) take no dropout: ``dropout`` applies to the adapters of linear layers.

    Example:
        >>> lora_model = apply_lora(build_llama("tiny"), rank=8)
    """
    if rank < 1:
        raise ValueError(f"lora rank={rank!r} is invalid; pass an int >= 1")
    peft = require_peft()
    extra = {"target_parameters": list(target_parameters)} if target_parameters else {}
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=target_modules,
        lora_dropout=dropout,
        modules_to_save=modules_to_save,
        use_dora=use_dora,
        use_rslora=use_rslora,
        fan_in_fan_out=fan_in_fan_out,
        **extra,
    )
    with _no_dropout_on_expert_parameters(peft) if dropout else contextlib.nullcontext():
        return peft.get_peft_model(model, config)


@contextlib.contextmanager
def _no_dropout_on_expert_parameters(peft):
    """While adapters are added: LoRA on a parameter (a mixture-of-experts layer's stacked
    expert weights, PEFT's ParamWrapper) is built without dropout, which it cannot apply
    (dropout(x) cannot be factored out of an expert-indexed matmul); the adapters of linear
    layers keep theirs. Other PEFT versions, without ParamWrapper, are left as they are."""
    import copy

    wrapper = getattr(getattr(getattr(peft, "tuners", None), "lora", None), "ParamWrapper", None)
    if wrapper is None:
        yield
        return
    original = wrapper.__init__

    def without_dropout(self, base_layer, adapter_name, parameter_name, config, *args, **kwargs):
        if getattr(config, "lora_dropout", 0):
            config = copy.copy(config)
            config.lora_dropout = 0.0
        original(self, base_layer, adapter_name, parameter_name, config, *args, **kwargs)

    wrapper.__init__ = without_dropout
    try:
        yield
    finally:
        wrapper.__init__ = original


def load_lora(model: nn.Module, adapter_dir: str) -> nn.Module:
    """``model`` with the LoRA adapter saved in ``adapter_dir`` (its own rank, alpha and
    targets), trainable: training goes on from its weights."""
    peft = require_peft()
    return peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
