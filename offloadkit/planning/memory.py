"""Bytes of one training step of a Llama-style decoder: what sits on the GPU at the peak,
in host RAM and on disk, for a given set of the components' options.

Every figure is a sum of named tensors (bf16 weights, fp32 norm upcasts, fp32 LoRA input
casts, SDPA's outputs and log-sum-exp, ...). The per-layer saved set is what autograd saves
inside one decoder layer; ``tests/cpu/test_planning.py`` checks it against the tensors a
tiny bf16 Llama really saves. Assumptions are the named constants below.

Layout of a step with checkpointing (the only mode the planner uses past short lengths):
forward keeps each layer's input (on the GPU, or offloaded), the loss runs chunk by chunk,
then backward recomputes one layer at a time. The GPU peak is the fixed part (weights,
trainable state, block inputs held on the GPU, rotary tables, the residual stream) plus the
largest of three moments: the loss phase, backward's start (one layer's recompute + backward
beside every layer's own saves, such as selective checkpointing's) and backward's end (the
first layer's, one layer's saves left, beside what arrives only then: the embedding's update).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TypeVar, Union

from offloadkit.checkpointing.footprint import attention_kept_bytes, keeps_attention
from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import Footprint, FootprintOptions, OptionSet
from offloadkit.components import COMPONENTS
from offloadkit.defaults import OPTIMIZER_STATE_BYTES, PREFETCH_FROM_DISK, PREFETCH_FROM_RAM
from offloadkit.engine.options import ActivationOptions
from offloadkit.layers.footprint import streams_weights
from offloadkit.layers.options import StreamingOptions
from offloadkit.longctx.footprint import (
    LOSS_CHUNK_BYTES_PER_LOGIT,
    NORM_BACKWARD_FP32,
    UNCHUNKED_LOSS_BYTES_PER_LOGIT,
    attention_workspace_bytes,
    mlp_saved_bytes,
    projections_tiled,
    tiled_mlp_shards,
)
from offloadkit.longctx.loss import auto_chunk_tokens
from offloadkit.longctx.options import LongContextOptions
from offloadkit.longctx.tiled_mlp import auto_num_shards
from offloadkit.lora.options import LoraOptions
from offloadkit.optim.footprint import optimizer_footprint
from offloadkit.optim.options import OptimizerOptions
from offloadkit.options import Options
from offloadkit.parallel.footprint import sharded_weights_footprint
from offloadkit.parallel.options import ParallelOptions
from offloadkit.planning.parallelism import Parallelism
from offloadkit.planning.shape import ModelShape
from offloadkit.storage.disk import MAX_INFLIGHT_BYTES
from offloadkit.storage.footprint import (
    block_placement,
    disk_staging_bytes,
    region_length,
    tiered_reserve_bytes,
)
from offloadkit.storage.options import BudgetOptions

__all__ = [
    "PLANNED_OPTIONS",
    "StepOptions",
    "long_context_counts",
    "long_context_options",
    "placed_by_counts",
    "step_options",
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
    "block_placement",
    "footprints",
    "layer_phase",
    "streams_weights",
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
        copy_window_bytes: GPU bytes of optimizer state in flight each way with the state in
            host memory: BackwardAdamW's ``copy_window_bytes`` argument, as the code that builds
            it passes it (None: its default for the precision, which the Trainer mixins use).
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
    copy_window_bytes: int | None = None

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


OptionsT = TypeVar("OptionsT", bound=Options)

# The components' options a plan chooses (:attr:`~offloadkit.planning.plan.Plan.options`,
# in this order); any other component's, the run's own, pass through a plan.
PLANNED_OPTIONS: tuple[type[Options], ...] = (
    CheckpointOptions,
    StreamingOptions,
    LongContextOptions,
    ActivationOptions,
    OptimizerOptions,
    LoraOptions,
    ParallelOptions,
    BudgetOptions,
)


@functools.lru_cache(maxsize=4096)
def long_context_options(
    loss_chunks: int, mlp_shards: int, tiled_projections: bool = False, head_groups: int = 1
) -> LongContextOptions:
    """The long-context parts' options for resolved counts: ``loss_chunks`` chunks (0: the
    unchunked loss), ``mlp_shards`` shards (1: untiled), the projections tiled with the MLP,
    attention over ``head_groups`` key/value head groups (1: whole). Shared: to read, not to
    change.

    Example:
        >>> long_context_options(8, 1).tiled_mlp
        False
    """
    # The projections tiled with the MLP in one shard: the tiled MLP's options at one shard
    # (the MLP then counts as untiled; the planner never chooses this).
    tiled = mlp_shards > 1 or tiled_projections
    return LongContextOptions(
        chunked_loss=loss_chunks > 0,
        loss_chunks=loss_chunks or None,
        tiled_mlp=tiled,
        mlp_shards=mlp_shards if tiled else None,
        tiled_projections=tiled_projections,
        head_groups=head_groups if head_groups > 1 else None,
    )


def long_context_counts(long: LongContextOptions) -> tuple[int, int, bool, int]:
    """The counts :func:`long_context_options` builds ``long`` from (a plan's: resolved):
    (loss chunks or 0, MLP shards or 1, tiled projections, head groups or 1)."""
    chunks = (long.loss_chunks or 0) if long.chunked_loss else 0
    shards = (long.mlp_shards or 1) if long.tiled_mlp else 1
    return chunks, shards, long.tiled_projections and long.tiled_mlp, long.head_groups or 1


def placed_by_counts(
    layers: int, offloaded_inputs: bool, gpu_blocks: int = 0, recompute_blocks: int = 0, ram_blocks: int | None = None
) -> list[str]:
    """Per decoder layer, where the planner's counts put its input in backward: ``gpu``,
    ``ram``, ``disk`` or ``recompute`` (what a plan writes as ``block_input_placement``).

    With ``offloaded_inputs`` (checkpointed and offloaded), the last layer's input stays on the
    GPU (backward needs it first), and so do the newest ``gpu_blocks`` before it. The
    ``recompute_blocks`` dropped inputs spread evenly over the offloaded ones (block 0's is
    always kept: there is nothing before it to replay from), so each run replays as few blocks
    as possible. ``ram_blocks`` of the stored ones wait in RAM (None: all): the tiered tier
    keeps the newest there and demotes the oldest to disk. Without ``offloaded_inputs``, every
    input stays on the GPU.

    Example:
        >>> placed_by_counts(4, True, recompute_blocks=1)
        ['ram', 'ram', 'recompute', 'gpu']
    """
    if not offloaded_inputs:
        return ["gpu"] * layers
    kept = max(0, min(layers - 1, gpu_blocks))
    offloaded = layers - 1 - kept
    stored = offloaded - max(0, min(recompute_blocks, offloaded - 1))
    heads = {j * offloaded // stored for j in range(stored)} if stored else set()
    in_ram = stored if ram_blocks is None else max(0, min(stored, ram_blocks))
    tiers = iter(["disk"] * (stored - in_ram) + ["ram"] * in_ram)
    prefix = [next(tiers) if i in heads else "recompute" for i in range(offloaded)]
    return prefix + ["gpu"] * (kept + 1)


# What a step's estimate reads its choices from: a tuple of components' options, or options
# a footprint reads.
StepOptions = Union[tuple, FootprintOptions]


def step_options(w: Workload, f: StepOptions) -> tuple[Workload, FootprintOptions]:
    """The workload and the components' options the footprints read for a step: a tuple of
    options is read as set (one not given has its defaults)."""
    if isinstance(f, tuple):
        return w, OptionSet(f)
    return w, f


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
        phase: whichever of these is larger: "loss", "layer backward" (at its start, every
            layer's own saves still held) or "first layer's backward" (at its end, what
            arrives only then beside one layer's saves).
        host_parts: named parts of ``host``.
    """

    gpu_peak: int
    gpu_reserved: int
    host: int
    disk: int
    block_placement: list[str]
    gpu_parts: dict[str, int] = field(default_factory=dict)
    phase: str = ""
    host_parts: dict[str, int] = field(default_factory=dict)


def _own_layer_saved_bytes(w: Workload, tiled_projections: bool = False) -> int:
    """One decoder layer's saved set outside its MLP (see :func:`layer_saved_bytes`)."""
    s, t, b = w.shape, w.tokens, w.dtype_bytes
    q, kv, h = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    if tiled_projections:
        return t * (b * (2 * q + 2 * kv) + 4 * s.heads + b * h)
    per_token = 2 * (4 * h + 4)  # two norms: fp32 input and fp32 rsqrt
    per_token += b * (2 * q + 2 * kv) + 4 * s.heads  # SDPA: q, k, v, out; fp32 log-sum-exp per head
    a = w.adapter_bytes
    if w.lora_rank:
        per_token += a * (3 * h + q) + 4 * a * w.lora_rank  # adapters of q, k, v, o: fp32 inputs, A outputs
    else:
        per_token += 2 * 2 * b * h  # each norm's normalised bf16 value and output
    return t * per_token


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
    return _own_layer_saved_bytes(w, tiled_projections) + mlp_saved_bytes(w, mlp_shards, tiled_projections)


def _own_attention_backward_bytes(w: Workload, tiled_projections: bool = False) -> int:
    """Attention's side of one layer's backward temporaries: its input gradients with the fp32
    norm gradient (tiled norms: two bf16 ``[S, H]`` gradients instead; with this the 8B LoRA
    probes at 384K and 512K tokens on an H100 peaked at 0.98x and 0.92x the prediction).
    SDPA's backward (cuDNN, the default on H100/H200 with torch 2.11) also takes 32,896 bytes
    a token of workspace for Llama-3-8B's heads, in one allocation; 3-layer probes at 64K,
    256K and 512K on an H200 peaked at 0.99x, 0.98x and 0.99x of this estimate all the same
    (benchmarks/results/longctx/recompute/), so it is not counted again. That one request is
    what fixed-size allocator segments cannot place at long context: see :data:`FRAGMENTATION`.
    The MLP's side is the tiled MLP's footprint; head groups and ring attention add theirs."""
    s, t, b = w.shape, w.tokens, w.dtype_bytes
    q, kv, h = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    return t * (b * (q + 2 * kv) + (2 * b * h if tiled_projections else NORM_BACKWARD_FP32 * 4 * h))


# Writes the disk tier stages in host RAM at once (offloadkit.storage.disk's default).
DISK_INFLIGHT_BYTES = MAX_INFLIGHT_BYTES


def _placement(w: Workload, o: FootprintOptions) -> list[str]:
    return block_placement(w.shape.layers, o)


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


def tiles_final_norm(f: FootprintOptions) -> bool:
    """Whether the norm after the layers runs tiled (with the tiled projections, over more
    than one shard)."""
    return projections_tiled(f) and tiled_mlp_shards(f) > 1


def footprints(w: Workload, f: StepOptions) -> list[tuple[str, Footprint]]:
    """Each part's footprint in this step, in the order they are summed: the optimizer's and
    FSDP2's sharded weights (the loop's or the Trainer's: not components
    :func:`~offloadkit.prepare` builds), then each component's of
    :data:`~offloadkit.components.COMPONENTS`, in apply order. Each reads only the workload
    and the components' options (:func:`step_options`)."""
    w, o = step_options(w, f)
    out = [("optimizer", optimizer_footprint(w, o)), ("sharded weights", sharded_weights_footprint(w, o))]
    return out + [(c.name, c.footprint(w, o)) for c in COMPONENTS if c.footprint is not None]


def _layer_saved(w: Workload, o: FootprintOptions, prints: list[Footprint]) -> int:
    return _own_layer_saved_bytes(w, projections_tiled(o)) + sum(p.layer_saved for p in prints)


def layer_phase(w: Workload, f: StepOptions, prints: list[Footprint] | None = None) -> dict[str, int]:
    """The named GPU bytes of one layer's backward phase beyond the fixed part: its recompute
    (under checkpointing), what the footprints hold beside it, and its backward temporaries,
    the larger of its MLP's and its attention's side; a footprint with a part name of its own
    shows what it raises that larger side by. ``prints``: the step's footprints (default:
    :func:`footprints`)."""
    w, o = step_options(w, f)
    if prints is None:
        prints = [p for _, p in footprints(w, o)]
    layer: dict[str, int] = {"layer recompute": _layer_saved(w, o, prints)} if o.of(CheckpointOptions).enabled else {}
    for p in prints:
        layer.update(p.layer)
    mlp = sum(p.mlp_backward for p in prints if not p.backward_part)
    attention = _own_attention_backward_bytes(w, projections_tiled(o))
    attention += sum(p.attention_backward for p in prints if not p.backward_part)
    layer["layer backward"] = max(mlp, attention)
    for p in prints:
        if p.backward_part:
            before = max(mlp, attention)
            mlp, attention = mlp + p.mlp_backward, attention + p.attention_backward
            layer[p.backward_part] = max(mlp, attention) - before
    return layer


def estimate_memory(w: Workload, f: StepOptions) -> MemoryEstimate:
    """Predict GPU peak, host RAM and disk bytes of one step: the model's own bytes (its
    weights, rotary tables, residual stream, final norm, each layer's saved set and backward
    temporaries outside the MLP) and the sum of every part's :func:`footprints`.

    Args:
        w: the workload.
        f: the components' options (a tuple of them: one not given has its defaults).

    Returns:
        A :class:`MemoryEstimate`.

    Example:
        >>> from offloadkit.planning.shape import resolve_shape
        >>> work = Workload(resolve_shape("llama-3-8b"), 16384)
        >>> from offloadkit.planning.plan import place_inputs, planned_options
        >>> m = estimate_memory(work, place_inputs(work, planned_options(work, offload_inputs=True, loss_chunks=8)))
        >>> m.block_placement[-1]
        'gpu'
    """
    w, o = step_options(w, f)
    s, t, b = w.shape, w.tokens, w.dtype_bytes
    prints = [p for _, p in footprints(w, o)]
    parts: dict[str, int] = {"weights": s.params * b}
    for p in prints:
        parts.update(p.gpu)  # a component's part replaces the model's of that name
    # cos and sin in fp32 then in the activations' dtype, shared by every layer.
    parts["rotary"] = 2 * t * s.head_dim * (4 + b)
    # The residual stream and its gradient, plus the layer output being formed.
    parts["residual stream"] = 3 * t * s.hidden * b
    fixed = sum(parts.values())

    # What each layer holds until its own backward: every layer's through the loss and the
    # first layers' backward, one layer's by the end of backward.
    per_layer: dict[str, int] = {}
    if not o.of(CheckpointOptions).enabled:
        per_layer["activations"] = _layer_saved(w, o, prints) + w.block_input_bytes
    for p in prints:
        per_layer.update(p.per_layer)
    held = {name: s.layers * n for name, n in per_layer.items()}

    loss: dict[str, int] = held | {"final norm": final_norm_bytes(w, tiles_final_norm(o))}
    for p in prints:
        loss.update(p.loss)
    layer = layer_phase(w, o, prints)
    ending = dict(layer)
    for p in prints:
        ending.update({name: n for name, n in p.layer_end.items() if name in ending})
    phases = [("loss", loss), ("layer backward", held | layer)]
    if ending != layer:
        phases.append(("first layer's backward", dict(per_layer) | ending))
    phase, extra = phases[0]
    for name, named in phases[1:]:  # the earlier phase on a tie
        if sum(named.values()) > sum(extra.values()):
            phase, extra = name, named
    parts.update(extra)
    gpu_peak = int(fixed + sum(extra.values()))

    # What is saved after the last block (see :func:`final_norm_saves`) stays on the GPU, where
    # the loss phase counts it: backward needs it first, before any block's recompute.
    host_parts = {"process baseline": HOST_BASELINE_BYTES}
    for p in prints:
        for name, n in p.host.items():
            host_parts[name] = host_parts.get(name, 0) + n
    return MemoryEstimate(
        gpu_peak=gpu_peak,
        gpu_reserved=int(gpu_peak * FRAGMENTATION),
        host=sum(host_parts.values()),
        disk=sum(p.disk for p in prints),
        block_placement=_placement(w, o),
        gpu_parts=parts,
        phase=phase,
        host_parts=host_parts,
    )
