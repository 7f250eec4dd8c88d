"""The model zoo: Llama-style models from named shapes, randomly initialised (no network, no
checkpoints). The shapes are plain data the planner and the CLI read; building a model needs
transformers."""

from __future__ import annotations

import torch

__all__ = ["LLAMA_SHAPES", "build_llama", "make_batch"]

# name -> LlamaConfig keyword arguments
LLAMA_SHAPES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=2048,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "llama-3.2-3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "llama-3-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
}


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("this needs Hugging Face transformers: pip install 'offloadkit[hf]'") from exc
    return transformers


def build_llama(
    shape: str | dict = "tiny",
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str = "eager",
    max_position_embeddings: int = 131072,
    **overrides,
):
    """A ``LlamaForCausalLM`` with random weights (deterministic for a given ``seed``).

    Args:
        shape: a key of :data:`LLAMA_SHAPES` or a dict of config fields.
        dtype, device: where the weights live.
        attn_implementation: "eager" is deterministic in backward; "sdpa" is fast.

    Example:
        >>> model = build_llama("tiny")
        >>> model.config.num_hidden_layers
        2
    """
    transformers = _require_transformers()
    fields = dict(LLAMA_SHAPES[shape]) if isinstance(shape, str) else dict(shape)
    fields.update(overrides)
    config = transformers.LlamaConfig(max_position_embeddings=max_position_embeddings, **fields)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: no full-precision copy of big shapes
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype=dtype)


def make_batch(vocab_size: int, batch: int, seq_len: int, device="cpu", seed: int = 0) -> dict:
    """Random token ids with labels equal to the inputs (the model shifts them)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids.clone()}
