"""What the long-context parts cost in one step, beside their code: the bytes and FLOPs the
planner (``planning/memory.py``, ``planning/timing.py``) counts for the chunked loss
(``causal_lm.py``, ``loss.py``), the tiled MLP (``tiled_mlp.py``) and attention over head
groups (``attention_groups.py``). Each component's record (``longctx/component.py``) names
its function here; the planner calls the same functions.

The workload is the planner's ``Workload``, read through the protocols of
:mod:`offloadkit.component` (the runtime never imports the planner); each reads its own
options, :class:`~offloadkit.longctx.options.LongContextOptions`, and checkpointing's, as the
run or a plan sets them (``f.of``; a plan's counts are resolved, never automatic).
"""

from __future__ import annotations

import math

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import Footprint, FootprintOptions
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.longctx.attention_groups import kv_head_groups
from offloadkit.longctx.options import LongContextOptions

__all__ = [
    "LOSS_CHUNK_BYTES_PER_LOGIT",
    "UNCHUNKED_LOSS_BYTES_PER_LOGIT",
    "attention_workspace_bytes",
    "chunked_loss_footprint",
    "head_groups_backward_bytes",
    "head_groups_footprint",
    "NORM_BACKWARD_FP32",
    "mlp_backward_bytes",
    "mlp_backward_bytes_per_token",
    "mlp_saved_bytes",
    "tiled_mlp_shards",
    "projections_tiled",
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
# fp32 ``[S, H]`` tensors an eager (untiled) RMSNorm's backward holds at once beside its
# input's gradient: the upcast gradient and the two paths through the scale. Attention's side
# of a layer's backward ends in the input norm's (``planning/memory.py``).
NORM_BACKWARD_FP32 = 3


def chunked_loss_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """The loss phase's bytes: one chunk's logits, the hidden states' gradient the chunked
    loss computes in forward and, in a full fine-tune, the head's fp32 weight gradient summed
    over the chunks; without ``chunked_loss``, Hugging Face's whole logits instead."""
    s, t = w.shape, w.tokens
    long = f.of(LongContextOptions)
    if not long.chunked_loss:
        return Footprint(loss={"logits": int(t * s.vocab * UNCHUNKED_LOSS_BYTES_PER_LOGIT)})
    loss = {
        "loss chunk": math.ceil(t / (long.loss_chunks or 1)) * s.vocab * LOSS_CHUNK_BYTES_PER_LOGIT,
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


def mlp_backward_bytes_per_token(w: Workload) -> int:
    """The eager gated MLP's backward temporaries a token: two bf16 and one fp32 tensor of
    the intermediate width."""
    return (2 * w.dtype_bytes + 4) * w.shape.intermediate


def mlp_backward_bytes(w: Workload, mlp_shards: int = 1) -> int:
    """Temporaries of one MLP shard's backward (:func:`mlp_backward_bytes_per_token` a
    token), plus, tiled, the shard's own saved set rebuilt in backward."""
    s, b = w.shape, w.dtype_bytes
    h, i = s.hidden, s.intermediate
    shard_tokens = math.ceil(w.tokens / max(1, mlp_shards))
    mlp = mlp_backward_bytes_per_token(w) * shard_tokens
    if mlp_shards > 1:
        mlp += (3 * b * i + (w.adapter_bytes * (2 * h + i) if w.lora_rank else b * i)) * shard_tokens
    return mlp


def projections_tiled(f: FootprintOptions) -> bool:
    """Whether the norms and attention projections run tiled (``tiled_projections``, with the
    tiled MLP)."""
    long = f.of(LongContextOptions)
    return long.tiled_mlp and long.tiled_projections


def tiled_mlp_shards(f: FootprintOptions) -> int:
    """Shards of the tiled MLP as the features' options set them (1: untiled)."""
    long = f.of(LongContextOptions)
    return (long.mlp_shards or 1) if long.tiled_mlp else 1


def tiled_mlp_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """The MLP's saved set and backward temporaries over ``mlp_shards`` shards (1: untiled),
    and, with the projections tiled under checkpointing, the attention projections' forward
    once more (the tiled norms and projections are recomputed and run again in their own
    backward; the tiled MLP's forward in its backward replaces the recompute the layer skips:
    tiled_mlp.py, ``OUTPUT_ONLY_ADDED``)."""
    s, shards, tiled_projections = w.shape, tiled_mlp_shards(f), projections_tiled(f)
    flops = 0
    if f.of(CheckpointOptions).enabled and tiled_projections:
        projections = sum(a * b for a, b in s.linears) - sum(a * b for a, b in s.linears[4:])
        flops = 2 * projections * s.layers * w.tokens
    return Footprint(
        layer_saved=mlp_saved_bytes(w, shards, tiled_projections),
        mlp_backward=mlp_backward_bytes(w, shards),
        backward_flops=flops,
    )


def attention_workspace_bytes(w: Workload) -> int:
    """The fused attention backward's workspace for all heads: two fp32 query-sized buffers
    and an fp32 value per head and token (32,896 bytes a token for Llama-3-8B with cuDNN on
    an H100; flash takes more, 49,280)."""
    s = w.shape
    return w.tokens * (8 * s.heads * s.head_dim + 4 * s.heads)


def head_groups_backward_bytes(w: Workload, head_groups: int = 1) -> tuple[int, int]:
    """What attention over ``head_groups`` groups of key/value heads (as
    :func:`~offloadkit.longctx.attention_groups.kv_head_groups` splits them; 1: whole) adds
    to one layer's backward: (the MLP's side, attention's side).

    The groups' outputs are joined into one more copy, which the o projection saves until its
    backward, before the attention's: the MLP's backward sees it. The kernel's workspace is
    not counted apart (it was absorbed by the calibration against measured peaks); the
    backward holds one group's, and what grouping takes off, ``(1 - 1/G)`` of it, is counted
    less the input gradients, which the groups hold apart until the last one is done and then
    join into one more copy. Each group's output gradient is copied into its output's strides
    for the kernel (``attention_groups._GradInOutputLayout``)."""
    s, t, b = w.shape, w.tokens, w.dtype_bytes
    groups = kv_head_groups(head_groups, s.kv_heads)
    if groups <= 1:
        return 0, 0
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    off = max(0, attention_workspace_bytes(w) * (groups - 1) // groups - t * b * (q + 2 * kv))
    return t * b * q, t * b * q // groups - off


def head_groups_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """The backward temporaries attention over ``head_groups`` groups adds and takes off
    (:func:`head_groups_backward_bytes`)."""
    mlp, attention = head_groups_backward_bytes(w, f.of(LongContextOptions).head_groups or 1)
    return Footprint(mlp_backward=mlp, attention_backward=attention)
