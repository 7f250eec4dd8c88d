"""What the long-context parts cost in one step, beside their code: the bytes and FLOPs the
planner (``planning/memory.py``, ``planning/timing.py``) counts for the chunked loss
(``causal_lm.py``, ``loss.py``) and the tiled MLP (``tiled_mlp.py``). Each component's record
(``longctx/component.py``) names its function here; the planner calls the same functions.

The workload and features are the planner's ``Workload`` and ``Features``, read through the
protocols of :mod:`offloadkit.component` (the runtime never imports the planner).
"""

from __future__ import annotations

import math

from offloadkit.component import Footprint
from offloadkit.component import FootprintFeatures as Features
from offloadkit.component import FootprintWorkload as Workload

__all__ = [
    "LOSS_CHUNK_BYTES_PER_LOGIT",
    "UNCHUNKED_LOSS_BYTES_PER_LOGIT",
    "chunked_loss_footprint",
    "mlp_backward_bytes",
    "mlp_saved_bytes",
    "tiled_mlp_footprint",
]

# Bytes per logit element of the unchunked Hugging Face loss at its peak (bf16 logits, fp32
# log-softmax and its gradient, part of the fp32 upcast). Derived from the 8B LoRA 16K
# checkpointing peak measured on H200 (benchmarks/results/engine/llama-3-8b-lora-16k-h200.md:
# 42.92 GiB allocated, minus this model's other parts, over 16384 x 128256 logits).
UNCHUNKED_LOSS_BYTES_PER_LOGIT = 11.5
# Bytes per element of one loss chunk at its peak: the bf16 matmul output while it becomes
# fp32 (2 + 4), then fp32 exp in place with its bf16 gradient (4 + 2); see loss.py.
LOSS_CHUNK_BYTES_PER_LOGIT = 6


def chunked_loss_footprint(w: Workload, f: Features) -> Footprint:
    """The loss phase's bytes: one chunk's logits, the hidden states' gradient the chunked
    loss computes in forward and, in a full fine-tune, the head's fp32 weight gradient summed
    over the chunks; with ``loss_chunks`` 0 (off), Hugging Face's whole logits instead."""
    s, t = w.shape, w.tokens
    if not f.loss_chunks:
        return Footprint(loss={"logits": int(t * s.vocab * UNCHUNKED_LOSS_BYTES_PER_LOGIT)})
    loss = {
        "loss chunk": math.ceil(t / f.loss_chunks) * s.vocab * LOSS_CHUNK_BYTES_PER_LOGIT,
        "hidden gradient": t * s.hidden * w.dtype_bytes,  # computed in forward by the chunked loss
    }
    if not w.lora_rank:
        # A trainable head's weight gradient is summed over chunks in fp32 during forward
        # and held until backward (1.96 GiB for Llama-3's 128K x 4096 head).
        loss["head weight gradient (fp32)"] = s.vocab * s.hidden * 4
    return Footprint(loss=loss)


def mlp_saved_bytes(w: Workload, mlp_shards: int = 1, tiled_projections: bool = False) -> int:
    """Bytes one decoder layer's MLP saves for backward: untiled, gate, up, SiLU and product
    (LoRA: gate, up, SiLU and the gate/up/down adapters' fp32 inputs and rank-r activations);
    tiled, only its bf16 input (a full fine-tune's is the norm's output, saved by the norm);
    with the projections tiled too, nothing of its own (the norm's input, which the norm saves)."""
    if tiled_projections:
        return 0
    s, t, b, a = w.shape, w.tokens, w.dtype_bytes, w.adapter_bytes
    h, i = s.hidden, s.intermediate
    if w.lora_rank:
        if mlp_shards <= 1:
            return t * (3 * b * i + a * (2 * h + i) + 3 * a * w.lora_rank)
        return t * b * h
    return t * 4 * b * i if mlp_shards <= 1 else 0


def mlp_backward_bytes(w: Workload, mlp_shards: int = 1) -> int:
    """Temporaries of one MLP shard's backward: two bf16 and one fp32 tensor of the
    intermediate width per token, plus, tiled, the shard's own saved set rebuilt in backward."""
    s, b = w.shape, w.dtype_bytes
    h, i = s.hidden, s.intermediate
    shard_tokens = math.ceil(w.tokens / max(1, mlp_shards))
    mlp = (2 * b + 4) * i * shard_tokens
    if mlp_shards > 1:
        mlp += (3 * b * i + (w.adapter_bytes * (2 * h + i) if w.lora_rank else b * i)) * shard_tokens
    return mlp


def tiled_mlp_footprint(w: Workload, f: Features) -> Footprint:
    """The MLP's saved set and backward temporaries over ``mlp_shards`` shards (1: untiled),
    and, with the projections tiled under checkpointing, the attention projections' forward
    once more (the tiled norms and projections are recomputed and run again in their own
    backward; the tiled MLP's forward in its backward replaces the recompute the layer skips:
    tiled_mlp.py, ``OUTPUT_ONLY_ADDED``)."""
    s = w.shape
    flops = 0
    if f.checkpointing and f.tiled_projections:
        projections = sum(a * b for a, b in s.linears) - sum(a * b for a, b in s.linears[4:])
        flops = 2 * projections * s.layers * w.tokens
    return Footprint(
        layer_saved=mlp_saved_bytes(w, f.mlp_shards, f.tiled_projections),
        layer_backward=mlp_backward_bytes(w, f.mlp_shards),
        backward_flops=flops,
    )
