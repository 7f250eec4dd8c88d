"""Bytes of one training step of a Llama-style decoder: what sits on the GPU at the peak,
in host RAM and on disk, for a given set of offloadkit features.

Every figure is a sum of named tensors (bf16 weights, fp32 norm upcasts, fp32 LoRA input
casts, SDPA's outputs and log-sum-exp, ...). The per-layer saved set is what autograd saves
inside one decoder layer; ``tests/cpu/test_planning.py`` checks it against the tensors a
tiny bf16 Llama really saves. Assumptions are the named constants below.

Layout of a step with checkpointing (the only mode the planner uses past short lengths):
forward keeps each layer's input (on the GPU, or offloaded), the loss runs chunk by chunk,
then backward recomputes one layer at a time. The GPU peak is the fixed part (weights,
trainable state, block inputs held on the GPU, rotary tables, the residual stream) plus the
larger of the loss phase and one layer's recompute + backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from offloadkit.defaults import (
    COMPACT_CHUNK_BYTES_PER_ELEMENT,
    COMPACT_CHUNK_ELEMENTS,
    OPTIMIZER_COPY_WINDOW_BYTES,
    OPTIMIZER_STATE_BYTES,
    PREFETCH_FROM_DISK,
    PREFETCH_FROM_RAM,
    STREAM_DEPTH,
)
from offloadkit.longctx.attention_groups import kv_head_groups
from offloadkit.longctx.footprint import (
    LOSS_CHUNK_BYTES_PER_LOGIT,
    UNCHUNKED_LOSS_BYTES_PER_LOGIT,
    attention_workspace_bytes,
    chunked_loss_footprint,
    head_groups_backward_bytes,
    mlp_backward_bytes,
    mlp_saved_bytes,
)
from offloadkit.longctx.loss import auto_chunk_tokens
from offloadkit.longctx.tiled_mlp import auto_num_shards
from offloadkit.planning.parallelism import Parallelism, ring_buffer_bytes, ring_rotation
from offloadkit.planning.shape import ModelShape
from offloadkit.storage.disk import MAX_INFLIGHT_BYTES
from offloadkit.storage.tiered import RESERVE_BYTES, RESERVE_CAP_DIVISOR

__all__ = [
    "Features",
    "Workload",
    "MemoryEstimate",
    "estimate_memory",
    "layer_saved_bytes",
    "FRAGMENTATION",
    "UNCHUNKED_LOSS_BYTES_PER_LOGIT",
    "LOSS_CHUNK_BYTES_PER_LOGIT",
    "HOST_BASELINE_BYTES",
    "auto_loss_chunks",
    "disk_staging_bytes",
    "tiered_reserve_bytes",
    "auto_mlp_shards",
    "tiles_projections",
    "region_length",
    "final_norm_bytes",
    "final_norm_saves",
    "tiles_final_norm",
    "attention_kept_bytes",
    "attention_workspace_bytes",
    "keeps_attention",
]

# The caching allocator reserves more than is allocated (block rounding, freed blocks that
# cannot be merged): reserved ~= allocated x this with expandable segments (1.13-1.14x
# measured at the 16 and 24 GiB caps), which offloadkit switches on for planned runs. With
# the default fixed-size segments the same 512K step reserved 1.66x what it allocated, and
# at 1.13M tokens SDPA's 34.7 GiB backward workspace found no room on a 141 GB H200.
FRAGMENTATION = 1.10
# The loss's bytes per logit (UNCHUNKED_LOSS_BYTES_PER_LOGIT, LOSS_CHUNK_BYTES_PER_LOGIT) and the
# MLP's saved set and backward temporaries are the long-context components' footprints,
# stated beside their code (offloadkit/longctx/footprint.py).
# Host RSS of a CUDA PyTorch process with transformers and peft imported, before any
# offloading. Assumed (typical: 3-5 GiB).
HOST_BASELINE_BYTES = 4 << 30
# Block inputs brought back ahead in backward: the engine's default horizon, the storage
# tiers' ``default_prefetch`` (from RAM, and from disk or RAM-then-disk).
HORIZON_RAM, HORIZON_DISK = PREFETCH_FROM_RAM, PREFETCH_FROM_DISK


def auto_loss_chunks(tokens: int, vocab: int) -> int:
    """Chunks of the automatic chunked loss (:func:`offloadkit.longctx.loss.auto_chunk_tokens`
    tokens each: at most 2**28 fp32 logits per chunk)."""
    return max(1, math.ceil(tokens / auto_chunk_tokens(vocab)))


def tiles_projections(tokens: int, hidden: int) -> bool:
    """Whether the automatic shard count tiles the norms and projections (more than 2**28
    elements in one ``[tokens, hidden]`` tensor)."""
    return auto_mlp_shards(tokens, hidden) > 1


def auto_mlp_shards(tokens: int, intermediate: int) -> int:
    """Shards of the automatic tiled MLP (:func:`offloadkit.longctx.tiled_mlp.auto_num_shards`:
    at most 2**28 intermediate elements per shard)."""
    return auto_num_shards(tokens, intermediate)


@dataclass(frozen=True)
class Workload:
    """What is trained: the shape, tokens and precision.

    Attributes:
        shape: the model.
        seq_len / batch: tokens per row and rows per step.
        lora_rank: 0 for a full fine-tune.
        dtype_bytes: bytes per weight and activation element (2 for bf16).
        adapter_bytes: bytes per LoRA parameter (PEFT keeps adapters in fp32 by default).
        optimizer_precision: a full fine-tune's AdamW state: "params" (two moments in the
            weights' dtype), "fp32_master" (fp32 master weights and moments: 12 bytes) or
            "compact" (bf16 moments, stochastic rounding: 4 bytes).
        updates_in_backward: with the optimizer state in host memory, each parameter is
            updated in backward as its gradient completes (no clipping, no fp16 loss scaling,
            no gradient accumulation). False, the Trainer's default (``max_grad_norm=1.0``):
            the updates wait for ``step()``, and every gradient is held until then.
        parallel: the ranks of the run (:class:`~offloadkit.planning.parallelism.Parallelism`);
            split over them, ``seq_len`` is still the whole sequence and :attr:`tokens` this
            rank's share. Default: one GPU.
    """

    shape: ModelShape
    seq_len: int
    batch: int = 1
    lora_rank: int = 16
    dtype_bytes: int = 2
    adapter_bytes: int = 4
    optimizer_precision: str = "params"
    updates_in_backward: bool = False
    parallel: Parallelism = Parallelism()

    def __post_init__(self) -> None:
        self.parallel.check_seq_len(self.seq_len)

    @property
    def optimizer_state_bytes(self) -> int:
        """AdamW state per trained parameter of a full fine-tune."""
        if self.optimizer_precision == "params":
            return 2 * self.dtype_bytes
        return OPTIMIZER_STATE_BYTES[self.optimizer_precision]

    @property
    def tokens(self) -> int:
        """Tokens this rank holds: every row's, or its share of them when each sequence is
        split over ranks. Everything token-wise is planned for these."""
        return self.seq_len * self.batch // self.parallel.sequence_ranks

    @property
    def sequence_tokens(self) -> int:
        """Tokens of the step's whole rows (every rank's)."""
        return self.seq_len * self.batch

    @property
    def block_input_bytes(self) -> int:
        """One decoder layer's input ``[B, S, H]``."""
        return self.tokens * self.shape.hidden * self.dtype_bytes


@dataclass(frozen=True)
class Features:
    """Which offloadkit features are on.

    Attributes:
        checkpointing: checkpoint every decoder layer.
        offload_inputs: offload block inputs (all but the last layer's).
        ram_blocks: how many offloaded block inputs fit in the RAM budget (the rest go to
            disk, oldest first); None: all in RAM.
        gpu_blocks: block inputs kept on the GPU besides the last layer's (the newest ones,
            needed first in backward), where the GPU has room the RAM and disk lack.
        layer_streaming / stream_depth: stream the layers' weights, layers resident (a full
            fine-tune's only with ``optimizer_offloading``: the update runs in backward, or,
            deferred to ``step()``, reads and writes the weights where they rest).
        loss_chunks: chunks of the chunked loss; 0: the unchunked loss.
        mlp_shards: shards of the tiled MLP; 1: untiled.
        tiled_projections: the norms and attention projections run tiled too (they save
            only their bf16 inputs).
        horizon: offloaded block inputs brought back ahead in backward (None: the engine's
            default, 2 from RAM and 4 from disk).
        optimizer_offloading: a full fine-tune's AdamW state in host memory (BackwardAdamW):
            no state held on the GPU beyond one parameter's and the copy window, and, with
            ``Workload.updates_in_backward``, one gradient at a time (else every gradient,
            until ``step()``).
        copy_window_bytes: GPU bytes of optimizer state in flight, each way (None: BackwardAdamW's
            default for the precision).
        recompute_blocks: offloaded block inputs dropped instead (kept nowhere, recomputed in
            backward from the kept input before them), spread evenly so that the runs between
            kept inputs are as short as possible.
        head_groups: key/value head groups each layer's attention runs in (1: whole); its
            backward then holds one group's kernel workspace.
        keep_attention: layers (the last ones) whose attention output and log-sum-exp wait
            in host RAM for the recompute, which then skips their attention forward
            (``keep_attention_outputs``).
        rotation: with a sequence split over ranks, how ring attention moves keys and values
            ("allgather" or "alltoall"); None: the run's own
            (:func:`~offloadkit.planning.parallelism.ring_rotation`).
    """

    checkpointing: bool = True
    offload_inputs: bool = False
    ram_blocks: int | None = None
    gpu_blocks: int = 0
    layer_streaming: bool = False
    stream_depth: int = STREAM_DEPTH
    loss_chunks: int = 0
    mlp_shards: int = 1
    tiled_projections: bool = False
    horizon: int | None = None
    optimizer_offloading: bool = False
    copy_window_bytes: int | None = None
    recompute_blocks: int = 0
    keep_attention: int = 0
    head_groups: int = 1
    rotation: str | None = None


def attention_kept_bytes(w: Workload) -> int:
    """One layer's attention output (bf16, as wide as q) and fp32 log-sum-exp per head."""
    s = w.shape
    return w.tokens * (w.dtype_bytes * s.heads * s.head_dim + 4 * s.heads)


def keeps_attention(f: Features) -> int:
    """Layers whose attention outputs are kept (it needs block inputs offloaded, by checkpointing)."""
    return f.keep_attention if f.checkpointing and f.offload_inputs else 0


@dataclass
class MemoryEstimate:
    """Predicted bytes. ``gpu_parts`` and ``phase`` explain ``gpu_peak``.

    Attributes:
        gpu_peak: predicted peak allocated bytes (``torch.cuda.max_memory_allocated``).
        gpu_reserved: the allocator's reservation at that peak (x :data:`FRAGMENTATION`);
            this is what must fit in the GPU budget.
        host: host RAM (pinned block inputs, streamed weights, disk staging, process baseline).
        disk: bytes of block inputs on disk.
        block_placement: per layer, where its input lives in backward: gpu, ram, disk, or
            recompute (kept nowhere: replayed from the kept input before it).
        gpu_parts: named parts of the peak.
        phase: "loss" or "layer backward", whichever is larger.
    """

    gpu_peak: int
    gpu_reserved: int
    host: int
    disk: int
    block_placement: list[str]
    gpu_parts: dict[str, int] = field(default_factory=dict)
    phase: str = ""


def layer_saved_bytes(w: Workload, mlp_shards: int = 1, tiled_projections: bool = False) -> int:
    """Bytes autograd saves inside one decoder layer (its recompute, under checkpointing).

    Counted per token: RMSNorm's fp32 input and rsqrt (twice), q/k/v and the SDPA output and
    fp32 log-sum-exp, and the MLP's gate, up, SiLU and product. Full fine-tuning also saves
    each norm's bf16 output and normalised value (for the weight gradients); LoRA instead
    saves each adapter's fp32 copy of its input and the rank-r activation. The MLP's own set
    is the tiled MLP's footprint (:func:`offloadkit.longctx.footprint.mlp_saved_bytes`: a
    tiled MLP saves only its input). Rotary tables are shared by all layers and counted once
    elsewhere. With the norms and projections tiled as well, a layer saves SDPA's set and one bf16
    ``[S, H]`` tensor, the post-attention residual: the modules a tiled norm feeds (q, k, v;
    the MLP) save the norm's input, which the norm saves anyway, and rebuild the norm's
    output in backward (the layer's input is the block input, counted apart). SDPA's output
    is the o projection's input (CUDA's attention kernels return it in ``[B, S, H, D]``
    memory, so no copy is made).
    """
    s, t, b = w.shape, w.tokens, w.dtype_bytes
    q, kv, h = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    mlp = mlp_saved_bytes(w, mlp_shards, tiled_projections)
    if tiled_projections:
        return t * (b * (2 * q + 2 * kv) + 4 * s.heads + b * h) + mlp
    per_token = 2 * (4 * h + 4)  # two norms: fp32 input and fp32 rsqrt
    per_token += b * (2 * q + 2 * kv) + 4 * s.heads  # SDPA: q, k, v, out; fp32 log-sum-exp per head
    a = w.adapter_bytes
    if w.lora_rank:
        per_token += a * (3 * h + q) + 4 * a * w.lora_rank  # adapters of q, k, v, o: fp32 inputs, A outputs
    else:
        per_token += 2 * 2 * b * h  # each norm's normalised bf16 value and output
    return t * per_token + mlp


def _layer_transient_bytes(
    w: Workload, mlp_shards: int, tiled_projections: bool = False, head_groups: int = 1, ring_bytes: int = 0
) -> int:
    """Largest set of temporaries while one layer runs backward: an MLP shard's recompute
    and gradients (:func:`offloadkit.longctx.footprint.mlp_backward_bytes`), or attention's
    input gradients with the fp32 norm gradient (tiled norms: two bf16 ``[S, H]`` gradients
    instead; with this the 8B LoRA probes at 384K and 512K tokens on an H100 peaked at 0.98x
    and 0.92x the prediction). SDPA's backward (cuDNN, the default on H100/H200 with torch
    2.11) also takes 32,896 bytes a token of workspace for Llama-3-8B's heads, in one
    allocation; 3-layer probes at 64K, 256K and 512K on an H200 peaked at 0.99x, 0.98x and
    0.99x of this estimate all the same (benchmarks/results/longctx/recompute/), so it is not
    counted again. That one request
    is what fixed-size allocator segments cannot place at long context: see
    :data:`FRAGMENTATION`. Run over ``head_groups`` groups of key/value heads the backward
    holds one group's workspace: the rest comes off, less the input gradients the groups hold
    apart and then join (:func:`offloadkit.longctx.footprint.head_groups_backward_bytes`).
    ``ring_bytes``: what ring attention holds beside it
    (:func:`~offloadkit.planning.parallelism.ring_buffer_bytes`)."""
    s, t, b = w.shape, w.tokens, w.dtype_bytes
    q, kv, h = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    mlp = mlp_backward_bytes(w, mlp_shards)
    attn = t * (b * (q + 2 * kv) + (2 * b * h if tiled_projections else 3 * 4 * h))
    grouped_mlp, grouped_attn = head_groups_backward_bytes(w, head_groups)  # head groups' footprint
    return max(mlp + grouped_mlp, attn + grouped_attn + ring_bytes)


# Writes the disk tier stages in host RAM at once (offloadkit.storage.disk's default).
DISK_INFLIGHT_BYTES = MAX_INFLIGHT_BYTES


def tiered_reserve_bytes(base: int) -> int:
    """The free room the tiered tier keeps under a cap of ``base`` plus this room
    (offloadkit.storage.tiered: ``min(RESERVE_BYTES, cap // RESERVE_CAP_DIVISOR)``, demoting
    the oldest entries to disk ahead of need). With ``cap = base + room`` and the room a
    ``1/D`` share of the cap, the room is ``base // (D - 1)``."""
    return min(RESERVE_BYTES, base // (RESERVE_CAP_DIVISOR - 1))


def disk_staging_bytes(w: Workload, f: Features, placement: list[str]) -> int:
    """Host buffers of the disk tier when block inputs spill: in backward the ones read ahead
    (the horizon) and the one in use (in forward the tiered tier demotes from its own RAM
    blocks; with every input on disk, every write is staged). They are reserved outside the
    RAM cap, so the host holds the cap plus these."""
    if "disk" not in placement:
        return 0
    horizon = f.horizon if f.horizon is not None else HORIZON_DISK
    reads = (horizon + 1) * w.block_input_bytes
    if "ram" in placement:
        return reads
    # Everything on disk: forward stages every write, up to the tier's in-flight limit.
    return max(reads, DISK_INFLIGHT_BYTES, w.block_input_bytes)


def _placement(w: Workload, f: Features) -> list[str]:
    layers = w.shape.layers
    if not (f.checkpointing and f.offload_inputs):
        return ["gpu"] * layers
    # The last layer's input stays (backward needs it first), and so do the newest
    # ``gpu_blocks`` before it.
    kept = max(0, min(layers - 1, f.gpu_blocks))
    offloaded = layers - 1 - kept
    # Dropped inputs spread evenly over the offloaded ones (block 0's is always kept: there
    # is nothing before it to replay from), so each run replays as few blocks as possible.
    stored = offloaded - max(0, min(f.recompute_blocks, offloaded - 1))
    heads = {j * offloaded // stored for j in range(stored)} if stored else set()
    in_ram = stored if f.ram_blocks is None else max(0, min(stored, f.ram_blocks))
    # The tiered store keeps the newest entries in RAM and demotes the oldest to disk.
    tiers = iter(["disk"] * (stored - in_ram) + ["ram"] * in_ram)
    prefix = [next(tiers) if i in heads else "recompute" for i in range(offloaded)]
    return prefix + ["gpu"] * (kept + 1)


def region_length(placement: list[str]) -> int:
    """Blocks in the longest run that one kept input replays (1: nothing is dropped)."""
    longest = run = 1
    for where in placement[1:]:
        run = run + 1 if where == "recompute" else 1
        longest = max(longest, run)
    return longest


def final_norm_saves(w: Workload, tiled: bool = False) -> list[int]:
    """Bytes of each tensor the final norm saves (its fp32 input and rsqrt; the normalised
    value too in a full fine-tune, for its weight's gradient; tiled, only its bf16 input) and
    of the head's input: a whole-model manager offloads these with the block inputs at the
    end of forward."""
    t, h, b = w.tokens, w.shape.hidden, w.dtype_bytes
    if tiled:
        return [t * b * h, t * b * h]
    return [t * 4 * h, t * 4, t * b * h] + ([t * b * h] if not w.lora_rank else [])


def final_norm_bytes(w: Workload, tiled: bool = False) -> int:
    """Their sum (see :func:`final_norm_saves`)."""
    return sum(final_norm_saves(w, tiled))


def tiles_final_norm(f: Features) -> bool:
    """Whether the norm after the layers runs tiled (with the tiled projections)."""
    return f.tiled_projections and f.mlp_shards > 1


def streams_weights(w: Workload, f: Features) -> bool:
    """Whether the layers' weights stream from host memory: a LoRA model's frozen base, or a
    full fine-tune's trainable weights when the optimizer updates them in backward."""
    return f.layer_streaming and (bool(w.lora_rank) or f.optimizer_offloading)


def estimate_memory(w: Workload, f: Features) -> MemoryEstimate:
    """Predict GPU peak, host RAM and disk bytes of one step.

    Args:
        w: the workload.
        f: the features.

    Returns:
        A :class:`MemoryEstimate`.

    Example:
        >>> from offloadkit.planning.shape import resolve_shape
        >>> work = Workload(resolve_shape("llama-3-8b"), 16384)
        >>> m = estimate_memory(work, Features(offload_inputs=True, loss_chunks=8))
        >>> m.block_placement[-1]
        'gpu'
    """
    s, t, b = w.shape, w.tokens, w.dtype_bytes
    h = s.hidden
    parts: dict[str, int] = {}
    edge = (s.embed_params + s.head_params + h) * b
    placement = _placement(w, f)
    replayed = region_length(placement)
    if streams_weights(w, f):
        # A replayed run holds its blocks resident together (longer runs than the depth cost more).
        resident = min(max(f.stream_depth, replayed), s.layers)
        parts["weights"] = edge + resident * s.layer_params * b
    else:
        parts["weights"] = s.params * b
    if w.lora_rank:
        parts["trainable state"] = s.lora_params(w.lora_rank) * w.adapter_bytes * 4  # param, grad, AdamW m and v
    elif f.optimizer_offloading:
        # The gradients and the state in flight: fetched ahead and on its way back, a window
        # each. The two hold different parameters (not yet updated, already updated), so
        # together never more than the state.
        largest = max(max(a * c for a, c in s.linears), s.embed_params, s.head_params)
        # Updated in backward, each gradient is freed at its update: one is held at a time.
        # Clipping needs every gradient's norm first, the fp16 scaler its inf/nan check, and
        # accumulation sums them over micro-steps: then all wait for step(), in the
        # parameters' dtype.
        held = largest if w.updates_in_backward else s.params
        grad = held * b
        # fp32 master weights widen one whole gradient at its update; the compact update one chunk.
        if w.optimizer_precision == "fp32_master":
            grad += largest * 4
        if w.optimizer_precision == "compact":
            grad += min(largest, COMPACT_CHUNK_ELEMENTS) * COMPACT_CHUNK_BYTES_PER_ELEMENT
        state = s.params * w.optimizer_state_bytes
        window = f.copy_window_bytes
        if window is None:
            window = OPTIMIZER_COPY_WINDOW_BYTES[w.optimizer_precision]
        in_flight = min(2 * window, state) + largest * w.optimizer_state_bytes
        parts["trainable state"] = grad + in_flight
    else:
        parts["trainable state"] = s.params * (b + w.optimizer_state_bytes)  # gradients and AdamW state
    block = w.block_input_bytes
    if f.checkpointing:
        on_gpu = placement.count("gpu")
        if f.offload_inputs:
            horizon = f.horizon if f.horizon is not None else HORIZON_DISK if "disk" in placement else HORIZON_RAM
            on_gpu += min(horizon, s.layers - 1)  # prefetched ahead in backward
        parts["block inputs"] = on_gpu * block
    else:
        parts["activations"] = s.layers * (layer_saved_bytes(w, f.mlp_shards, f.tiled_projections) + block)
    # cos and sin in fp32 then in the activations' dtype, shared by every layer.
    parts["rotary"] = 2 * t * s.head_dim * (4 + b)
    # The residual stream and its gradient, plus the layer output being formed.
    parts["residual stream"] = 3 * t * h * b
    fixed = sum(parts.values())

    loss: dict[str, int] = {"final norm": final_norm_bytes(w, tiles_final_norm(f))}
    loss.update(chunked_loss_footprint(w, f).loss)  # chunked, or Hugging Face's whole logits
    layer: dict[str, int] = {}
    if f.checkpointing:
        layer["layer recompute"] = layer_saved_bytes(w, f.mlp_shards, f.tiled_projections)
        if replayed > 1:
            # A run's replay holds the dropped inputs it recomputed until backward passes them.
            layer["replayed block inputs"] = (replayed - 1) * block
    layer["layer backward"] = _layer_transient_bytes(w, f.mlp_shards, f.tiled_projections, f.head_groups)
    ring = ring_buffer_bytes(w, kv_head_groups(f.head_groups, s.kv_heads), ring_rotation(w.parallel, f.rotation))
    if ring:
        # Held while the layer's attention runs backward, not while its MLP does: counted as
        # what it adds to the larger of the two.
        with_ring = _layer_transient_bytes(w, f.mlp_shards, f.tiled_projections, f.head_groups, ring)
        layer["ring attention buffers"] = with_ring - layer["layer backward"]
    loss_bytes, layer_bytes = sum(loss.values()), sum(layer.values())
    if loss_bytes >= layer_bytes:
        phase, extra = "loss", loss
    else:
        phase, extra = "layer backward", layer
    parts.update(extra)
    gpu_peak = int(fixed + max(loss_bytes, layer_bytes))

    # What is saved after the last block (see :func:`final_norm_saves`) stays on the GPU, where
    # the loss phase counts it: backward needs it first, before any block's recompute.
    host = HOST_BASELINE_BYTES + placement.count("ram") * block + disk_staging_bytes(w, f, placement)
    if streams_weights(w, f):
        host += s.layers * s.layer_params * b  # pinned host copies of the streamed layers
    if f.optimizer_offloading and not w.lora_rank:
        host += s.params * w.optimizer_state_bytes  # pinned AdamW state
    host += keeps_attention(f) * attention_kept_bytes(w)
    disk = placement.count("disk") * block
    return MemoryEstimate(
        gpu_peak=gpu_peak,
        gpu_reserved=int(gpu_peak * FRAGMENTATION),
        host=host,
        disk=disk,
        block_placement=placement,
        gpu_parts=parts,
        phase=phase,
    )
