"""Long-context training: the tensors that grow with sequence length, bounded per layer.

- :func:`chunked_cross_entropy` / :func:`apply_chunked_loss`: the loss over token chunks;
  the ``[tokens, vocab]`` logits (3.9 GiB in bf16 and 7.8 GiB in fp32 at 16K x 128256)
  are never held, one chunk of at most 1 GiB of fp32 logits at a time.
- :func:`apply_tiled_mlp`: each decoder layer's MLP over sequence shards; one shard's
  ``[tokens, intermediate]`` tensors at a time.

What else grows with length in a Llama-style decoder layer (S tokens, hidden H, heads of
dim d), and what bounds it:

- Layer inputs ``[S, H]`` (4 GiB at 512K x 4096 in bf16): saved per layer under
  checkpointing; checkpoint-input offloading moves them to host memory.
- RMSNorm upcasts ``[S, H]`` to fp32: the fp32 copy is saved for backward and two more fp32
  temporaries are made (8 GiB each at 512K x 4096). Tiling the norms with the same tiled
  function bounds them: ``apply_tiled_mlp(model, predicate=lambda n, m:
  n.endswith(("mlp", "layernorm")) or n == "model.norm")``.
- Rotary tables: cos and sin ``[S, d]``, built once per forward in fp32 (256 MiB each at
  512K x 128) and shared by all layers; applying them makes full-size copies of q and k.
- Attention masks: with ``attn_implementation="sdpa"``, one sequence per row and no padding
  (no mask, an all-ones mask, or ``arange`` position ids), Hugging Face passes
  ``attn_mask=None, is_causal=True`` and no ``[S, S]`` tensor is built; SDPA then holds
  O(S). Padding, or several documents packed in a row and told apart by position ids,
  makes it build a ``[B, 1, S, S]`` boolean mask (256 GiB at 512K): use
  ``flash_attention_2`` for packed documents. ``eager`` attention builds ``[B, heads, S, S]``
  scores. In training pass ``use_cache=False`` (checkpointing does): with a cache, Hugging
  Face does not mask packed documents from each other at all.
"""

from offloadkit.longctx.attention_groups import AttentionHeadGroups, apply_attention_head_groups
from offloadkit.longctx.causal_lm import ChunkedLossHandle, apply_chunked_loss
from offloadkit.longctx.loss import chunked_cross_entropy
from offloadkit.longctx.tiled_mlp import TiledMLPHandle, apply_tiled_mlp, tiled_forward

__all__ = [
    "AttentionHeadGroups",
    "ChunkedLossHandle",
    "TiledMLPHandle",
    "apply_attention_head_groups",
    "apply_chunked_loss",
    "apply_tiled_mlp",
    "chunked_cross_entropy",
    "tiled_forward",
]
