"""The dimensions of a decoder-only transformer that the planner needs, from a Hugging
Face config (dict, object or model directory) or a name in :data:`offloadkit.models.zoo.LLAMA_SHAPES`.

Only torch-free arithmetic lives here: reading a shape never imports transformers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["ModelShape", "resolve_shape"]

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder: embedding, ``layers`` x (attention + gated MLP), norm, head.

    Attributes:
        hidden / intermediate: model width and MLP width.
        layers: decoder layers.
        heads / kv_heads / head_dim: attention heads, key/value heads (GQA), per-head width.
        vocab: vocabulary size.
        tied: the head shares the embedding's weight.
        name: where the shape came from (for tables).

    Example:
        >>> ModelShape.from_config({"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        ...                         "num_attention_heads": 4, "vocab_size": 256}).kv_heads
        4
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    name: str = "custom"

    @classmethod
    def from_config(cls, config: Any, name: str = "custom") -> "ModelShape":
        """From a Hugging Face config object or its ``to_dict()``."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        missing = [
            k
            for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if get(k) is None
        ]
        if missing:
            raise ValueError(
                f"model config lacks {missing}; the planner needs a decoder-only transformer config "
                "(Llama, Mistral, Qwen2 and the like)"
            )
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        return cls(
            hidden=hidden,
            intermediate=int(get("intermediate_size")),
            layers=int(get("num_hidden_layers")),
            heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            vocab=int(get("vocab_size")),
            tied=bool(get("tie_word_embeddings", False)),
            name=name,
        )

    def with_layers(self, layers: int) -> "ModelShape":
        """The same layer shape at another depth."""
        if layers < 1:
            raise ValueError(f"layers={layers!r} must be >= 1")
        return replace(self, layers=layers)

    # -- parameter counts ------------------------------------------------------------
    @property
    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer: q, k, v, o, gate, up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (linears and two norms)."""
        return sum(a * b for a, b in self.linears) + 2 * self.hidden

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters."""
        return self.layers * self.layer_params + self.embed_params + self.head_params + self.hidden

    def lora_params(self, rank: int) -> int:
        """LoRA parameters (A and B of every linear of every layer; not the head)."""
        return self.layers * sum(rank * (a + b) for a, b in self.linears)


def resolve_shape(model: Any, layers: int | None = None) -> ModelShape:
    """A :class:`ModelShape` from a shape name, a model directory (its ``config.json``), a
    config dict or object, or a model with a ``.config``.

    Args:
        model: ``"llama-3-8b"``, ``"/models/Llama-3-8B"``, a dict, a config or a model.
        layers: override the depth (the same layer shape, fewer or more layers).

    Returns:
        The shape.

    Example:
        >>> resolve_shape("llama-3-8b", layers=4).layers
        4
    """
    if isinstance(model, ModelShape):
        shape = model
    elif isinstance(model, str):
        if os.path.isdir(model):
            path = os.path.join(model, "config.json")
            if not os.path.isfile(path):
                raise ValueError(f"model directory {model!r} has no config.json")
            with open(path) as f:
                data = json.load(f)
            data = data.get("text_config", data)  # multimodal wrappers keep the decoder's config inside
            shape = ModelShape.from_config(data, name=os.path.basename(os.path.normpath(model)))
        else:
            from offloadkit.models.zoo import LLAMA_SHAPES  # plain data; no transformers import

            if model not in LLAMA_SHAPES:
                raise ValueError(
                    f"model={model!r} is neither a directory nor a known shape; "
                    f"use a model directory or one of {sorted(LLAMA_SHAPES)}"
                )
            shape = ModelShape.from_config(LLAMA_SHAPES[model], name=model)
    elif isinstance(model, dict):
        shape = ModelShape.from_config(model)
    else:
        config = getattr(model, "config", model)
        shape = ModelShape.from_config(config, name=str(getattr(config, "_name_or_path", "") or "model"))
    return shape.with_layers(layers) if layers is not None else shape


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of ``"bfloat16"``, ``torch.bfloat16`` and the like."""
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not supported by the planner; use bfloat16, float16 or float32")
    return _DTYPE_BYTES[name]
