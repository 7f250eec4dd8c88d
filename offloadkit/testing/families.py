"""Small random models of the families users fine-tune, built from transformers configs (no
downloads), and batches for them: Llama, Qwen2, Qwen3, Mistral (sliding window), Gemma 2
(soft-capping, sliding window), Gemma 3, Phi-3 (fused qkv and gate_up), Qwen3-MoE and
Mixtral (router auxiliary loss), gpt-oss (attention sinks) and Qwen2-VL (a vision-language
model with an image in the batch). Test and benchmark helpers, not product code.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["FAMILIES", "build_family", "family_batch", "packed_batch"]

FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3",
    "phi3",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "qwen2_vl",
)
# Attention that builds no [seq, seq] scores where the family allows it; eager where the
# family needs it (soft-capping, sinks).
_EAGER = ("gemma2", "gpt_oss")
_SIZES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        head_dim=16,
    ),
    "bench": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        head_dim=64,
    ),
}


def _config(family: str, size: str):
    import transformers

    s = dict(_SIZES[size])
    tiny = size == "tiny"
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    window = 8 if tiny else 1024
    moe = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
    if family == "llama":
        s.pop("head_dim")
        return transformers.LlamaConfig(**s, **ids)
    if family == "qwen2":
        s.pop("head_dim")
        return transformers.Qwen2Config(**s, **ids)
    if family == "qwen3":
        return transformers.Qwen3Config(**s, **ids)
    if family == "mistral":
        return transformers.MistralConfig(**s, sliding_window=window, **ids)
    if family == "gemma2":
        return transformers.Gemma2Config(
            **s,
            sliding_window=window,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=s["head_dim"],
            **ids,
        )
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**s, sliding_window=window, query_pre_attn_scalar=s["head_dim"], **ids)
    if family == "phi3":
        s.pop("head_dim")
        return transformers.Phi3Config(**s, **ids)
    if family == "qwen3_moe":
        s["moe_intermediate_size"] = s["intermediate_size"] // 2
        return transformers.Qwen3MoeConfig(**s, num_experts=4, **moe, **ids)
    if family == "mixtral":
        s.pop("head_dim")
        return transformers.MixtralConfig(**s, num_local_experts=4, **moe, **ids)
    if family == "gpt_oss":
        layers = ["sliding_attention", "full_attention"] * (s["num_hidden_layers"] // 2)
        return transformers.GptOssConfig(
            **s, num_local_experts=4, sliding_window=window, layer_types=layers, **moe, **ids
        )
    if family == "qwen2_vl":
        s.pop("head_dim")
        vision = dict(
            depth=2,
            embed_dim=32 if tiny else 256,
            hidden_size=s["hidden_size"],
            num_heads=4,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        )
        text = dict(s, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3] if tiny else [8, 12, 12]}, **ids)
        return transformers.Qwen2VLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=s["vocab_size"] - 1,
            vision_start_token_id=s["vocab_size"] - 2,
            vision_end_token_id=s["vocab_size"] - 3,
        )
    raise ValueError(f"family {family!r} is not one of {FAMILIES}")


def build_family(
    family: str,
    size: str = "tiny",
    *,
    device="cpu",
    dtype=torch.float32,
    seed: int = 0,
    attn_implementation: str | None = None,
):
    """A randomly initialised causal LM of ``family`` ("tiny" for tests, "bench" for the
    GPU memory rows), in training mode."""
    import transformers

    config = _config(family, size)
    config._attn_implementation = attn_implementation or ("eager" if family in _EAGER else "sdpa")
    for sub in ("text_config", "vision_config"):
        if hasattr(config, sub):
            getattr(config, sub)._attn_implementation = config._attn_implementation
    torch.manual_seed(seed)
    if family == "qwen2_vl":
        model = transformers.Qwen2VLForConditionalGeneration(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(device=device, dtype=dtype).train()


def family_batch(family: str, model, seq_len: int, *, batch: int = 1, device="cpu", seed: int = 0) -> dict:
    """Token ids and labels (with an ignored prompt); for Qwen2-VL an image at the start."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = text.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab - 3, (batch, seq_len), generator=g)
    labels = ids.clone()
    labels[:, : seq_len // 8] = -100  # a prompt that is not trained on
    out = {"input_ids": ids, "labels": labels}
    if family == "qwen2_vl":
        vision = config.vision_config
        grid = (1, 8, 8)  # t, h, w patches: 64 patches, 16 tokens after the 2x2 merge
        tokens = grid[0] * grid[1] * grid[2] // vision.spatial_merge_size**2
        ids[:, 0] = config.vision_start_token_id
        ids[:, 1 : 1 + tokens] = config.image_token_id
        ids[:, 1 + tokens] = config.vision_end_token_id
        labels[:, : 2 + tokens] = -100
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        out["pixel_values"] = torch.randn(batch * grid[0] * grid[1] * grid[2], patch, generator=g)
        out["image_grid_thw"] = torch.tensor([grid] * batch)
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            kinds = torch.zeros_like(ids, dtype=torch.int32)
            kinds[:, 1 : 1 + tokens] = 1  # image tokens, for the multimodal rotary positions
            out["mm_token_type_ids"] = kinds
    dtype = next(model.parameters()).dtype
    return {k: (v.to(device, dtype) if k == "pixel_values" else v.to(device)) for k, v in out.items()}


def packed_batch(vocab: int, lengths: list[int], device="cpu", seed: int = 0) -> dict:
    """Documents packed into one row as TRL's padding-free collator makes them: positions
    restart at each document and the first token of each is not a target. ``use_cache``
    is off: transformers isolates packed documents only when no cache is being built."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab - 3, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = ids.clone()
    start = 0
    for n in lengths:
        labels[0, start] = -100
        start += n
    return {
        "input_ids": ids.to(device),
        "labels": labels.to(device),
        "position_ids": positions.to(device),
        "use_cache": False,
    }
