"""The planner's search: for a model, a sequence length and the machine's budgets, which
features to turn on, where each block input goes (GPU, pinned RAM, disk), the loss chunking and
MLP tiling, and the predicted peak, host and disk bytes and step time (a
:class:`~offloadkit.planning.plan.Plan`). The longest sequence that fits is
:mod:`~offloadkit.planning.capacity`'s. Every candidate is a set of components' options, and
each step of the search an edit of one component's (``dataclasses.replace``); the estimates
sum the footprints those options give.

Candidates, fastest first (offloading costs copies, streaming costs more copies): layer
checkpointing alone; with block inputs offloaded (pinned RAM up to the host budget, the
oldest to disk past it); with frozen layers streamed as well (LoRA). The chunked loss is on
in every candidate (it costs no extra work). Tiling costs one more forward of what it
tiles, so each candidate comes with the MLP untiled, tiled, and (past 2**28 / hidden
tokens) with the norms and attention projections tiled too. When a candidate does not fit
the GPU, the prefetch horizon is shortened: first to what still hides the fetch of a block
input behind the layers of backward ahead, then to 0 (each fetch is waited for, which the
step time counts; at long context a fetch is a small part of a layer's backward). The fastest candidate whose predicted
reservation, host and disk use fit wins; ties in time go to the lower peak.

Over several GPUs (:class:`~offloadkit.planning.parallelism.Parallelism`) the plan is one
rank's: its share of a sequence split over the ranks, within its share of the host's RAM and
disk; ``seq_len`` and the longest sequence are the whole sequence's. Each candidate's ring
attention rotates keys and values by all-gather where that fits (fewer, larger transfers)
and is as fast, else all-to-all (one neighbour's share on the GPU at a time), unless the run
fixes the rotation (:attr:`Parallelism.rotation`).
"""

from __future__ import annotations

import math

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import OptionSet
from offloadkit.components import COMPONENTS
from offloadkit.defaults import OPTIMIZER_STATE_BYTES, STREAM_DEPTH
from offloadkit.engine.footprint import default_horizon
from offloadkit.engine.options import ActivationOptions
from offloadkit.layers.options import StreamingOptions
from offloadkit.longctx.options import LongContextOptions
from offloadkit.lora.options import LoraOptions
from offloadkit.optim.footprint import optimizer_footprint
from offloadkit.optim.options import OptimizerOptions
from offloadkit.options import Options
from offloadkit.parallel.options import ParallelOptions
from offloadkit.planning.budgets import Budgets
from offloadkit.planning.memory import (
    FRAGMENTATION,
    HORIZON_DISK,
    HOST_BASELINE_BYTES,
    PLANNED_OPTIONS,
    MemoryEstimate,
    StepOptions,
    Workload,
    attention_kept_bytes,
    auto_loss_chunks,
    auto_mlp_shards,
    estimate_memory,
    keeps_attention,
    long_context_counts,
    long_context_options,
    step_options,
    tiered_reserve_bytes,
    tiles_projections,
)
from offloadkit.planning.parallelism import Parallelism
from offloadkit.planning.plan import (
    Choice,
    OptimizerSetup,
    Plan,
    _check,
    _streamed_host_bytes,
    input_counts,
    option,
    place_inputs,
    planned_options,
    with_options,
)
from offloadkit.planning.shape import ModelShape, resolve_shape
from offloadkit.planning.timing import StepTime, estimate_time
from offloadkit.storage.footprint import offloads_inputs
from offloadkit.storage.pool import size_class

__all__ = ["OptimizerSetup", "Plan", "SEQ_STEP", "plan"]

GiB = float(1 << 30)
# Sequence lengths are searched in multiples of this (kernels prefer aligned lengths).
SEQ_STEP = 1024


def _held_host_bytes(w: Workload, o: OptionSet) -> int:
    """Host RAM held beside the block inputs: the streamed layers, a full fine-tune's AdamW
    state in host memory (the optimizer's own, outside the engine's budget), and what the
    components the run sets and the planner does not choose keep there (the input embedding
    table: pinned memory of its own, outside the engine's budget too)."""
    state = optimizer_footprint(w, o).host.get("optimizer state", 0)  # each rank's share under FSDP2
    return _streamed_host_bytes(w, o) + state + _set_components_host_bytes(w, o)


def _set_components_host_bytes(w: Workload, o: OptionSet) -> int:
    kinds = {type(x) for x in o.options if type(x) not in PLANNED_OPTIONS}
    prints = (c.footprint(w, o) for c in COMPONENTS if c.options in kinds and c.footprint is not None)
    return sum(sum(p.host.values()) for p in prints)


def _ram_blocks(
    w: Workload, f: StepOptions, b: Budgets, gpu_blocks: int | None = None, recompute_blocks: int | None = None
) -> int:
    """Block inputs the host budget holds beside the streamed weights; when the rest spill to
    disk, also beside the disk tier's staging buffers and the room the tiered tier keeps free
    (what the engine does with the cap :meth:`Plan.host_budget_bytes` gives it). The block
    inputs on the GPU and dropped: ``gpu_blocks`` and ``recompute_blocks``, else where ``f``
    places them."""
    w, o = step_options(w, f)
    assert isinstance(o, OptionSet)
    placed_gpu, placed_drops = input_counts(w, o)
    gpu_blocks = placed_gpu if gpu_blocks is None else gpu_blocks
    recompute_blocks = placed_drops if recompute_blocks is None else recompute_blocks
    streamed = _streamed_host_bytes(w, o)
    state = _held_host_bytes(w, o) - streamed
    room = b.host_bytes - streamed - state
    per = size_class(w.block_input_bytes)
    if room // per >= w.shape.layers - 1 - gpu_blocks - recompute_blocks:
        return max(0, room // per)  # nothing spills: no staging, no demotion
    asked = o.of(ActivationOptions).loading_horizon
    horizon = asked if asked is not None else HORIZON_DISK
    staging = (horizon + 1) * per
    n = max(0, (room - staging) // per)
    # The cap (:meth:`Plan.host_budget_bytes`) covers the streamed weights too, and so does
    # the room the tiered tier keeps free under it.
    while n and n * per + streamed + tiered_reserve_bytes(n * per + streamed) + staging + state > b.host_bytes:
        n -= 1
    return n


def _placed(w: Workload, choice: Choice, b: Budgets, gpu_blocks: int = 0, recompute_blocks: int = 0) -> Choice:
    """``choice`` with block inputs placed: the newest ``gpu_blocks`` on the GPU,
    ``recompute_blocks`` dropped, of the rest as many in RAM as the host budget holds
    (:func:`_ram_blocks`) and the oldest on disk."""
    ram = _ram_blocks(w, choice, b, gpu_blocks, recompute_blocks)
    return place_inputs(w, choice, gpu_blocks, recompute_blocks, ram)


def _tiling(choice: Choice, **changes) -> Choice:
    """``choice`` with the long-context parts' counts changed (``loss_chunks``,
    ``mlp_shards``, ``tiled_projections``, ``head_groups``; see
    :func:`~offloadkit.planning.memory.long_context_options`)."""
    chunks, shards, projections, groups = long_context_counts(option(choice, LongContextOptions))
    counts = dict(loss_chunks=chunks, mlp_shards=shards, tiled_projections=projections, head_groups=groups) | changes
    long = long_context_options(**counts)
    return tuple(long if type(o) is LongContextOptions else o for o in choice)


def _streams(choice: Choice) -> bool:
    return option(choice, StreamingOptions).enabled


# How much finer than the automatic tiling the planner tries when a step does not fit.
FINER_TILES = (2, 4, 8, 16, 32)


# What a planned selective checkpointing saves (``selective_checkpointing``).
SELECTIVE_SAVED = ("mm", "attention")


def _candidates(
    w: Workload, b: Budgets, stream_depth: int, state_movable: bool = True, given: Choice = ()
) -> list[tuple[str, Choice]]:
    """The candidates plan() realises, as components' options (each an edit of the one
    before); ``given`` carries what every candidate shares and the planner does not choose
    (fused LoRA, the run's other options), so that the RAM share of block inputs is sized
    beside what those hold."""
    mlp_shards = auto_mlp_shards(w.tokens, w.shape.intermediate)
    base = planned_options(
        w,
        loss_chunks=auto_loss_chunks(w.tokens, w.shape.vocab),
        mlp_shards=mlp_shards,
        stream_depth=stream_depth,
        fused_lora=option(given, LoraOptions).fused is True,
        others=given,
    )
    offload = with_options(base, ActivationOptions, mode=True)
    out = [
        ("checkpointing", base),
        ("checkpointing + block-input offload", _placed(w, offload, b)),
    ]
    if not w.lora_rank and state_movable:
        # A full fine-tune's AdamW state in host memory (its gradients too, where the updates
        # run in backward); with it, the layers' weights can stream too.
        moved = {"enabled": True, "precision": w.optimizer_precision}
        for name, c in list(out):
            out.append((name + " + optimizer state in host memory", with_options(c, OptimizerOptions, **moved)))
        streamed = with_options(with_options(offload, OptimizerOptions, **moved), StreamingOptions, enabled=True)
        out.append(
            (
                "checkpointing + block-input offload + optimizer state in host memory + layer streaming",
                _placed(w, streamed, b),
            )
        )
    if w.lora_rank:
        streamed = with_options(offload, StreamingOptions, enabled=True)
        out.append(("checkpointing + block-input offload + layer streaming", _placed(w, streamed, b)))
    elif option(given, CheckpointOptions).selective is None:
        # A full fine-tune with room to spare: each layer's matmul and attention outputs
        # saved, so its recompute runs only the pointwise ops (the 3B at 16K with its state in
        # host memory on an H200: 1.29 s against 1.35 s; this plan through prepare() 1.33 s at
        # 43.8 GiB, predicted 44.5).
        # LoRA is left out: its fused path is refused beside saved matmuls, and PEFT's is slower.
        # So is layer streaming: a step that streams its weights waits on the link, which
        # saving outputs does not shorten.
        out += [
            (name + " + selective checkpointing", with_options(c, CheckpointOptions, selective=list(SELECTIVE_SAVED)))
            for name, c in out
            if not _streams(c)
        ]
    tiled = out
    out = []
    if mlp_shards > 1:
        # Tiling costs the tiled modules' forward once more: each variant is offered untiled
        # first, and plan() keeps the fastest that fits.
        out += [(name + " (MLP untiled)", _tiling(c, mlp_shards=1)) for name, c in tiled]
    out += tiled
    if mlp_shards > 1 and tiles_projections(w.tokens, w.shape.hidden):
        out += [
            (name + " + tiled projections", _tiling(c, tiled_projections=True, head_groups=w.shape.kv_heads))
            for name, c in tiled
        ]
    # Small GPUs: a layer's working set (the MLP's intermediate, the projections' outputs,
    # the logits of a loss chunk) shrinks with finer tiles, at the cost of more and smaller
    # kernels; offered last, so a GPU with room keeps the coarser tiles.
    for factor in FINER_TILES:
        out += [
            (
                f"{name} + tiled projections, {max(2, mlp_shards) * factor} shards",
                _tiling(
                    c,
                    mlp_shards=max(2, mlp_shards) * factor,
                    tiled_projections=True,
                    head_groups=w.shape.kv_heads,
                    loss_chunks=long_context_counts(option(c, LongContextOptions))[0] * factor,
                ),
            )
            for name, c in tiled
        ]
    # Last resort for the smallest GPUs: one streamed layer resident instead of two (its
    # weights' copy is then waited for, not overlapped).
    out += [
        (name + ", one streamed layer resident", with_options(c, StreamingOptions, depth=1))
        for name, c in out[-len(tiled) :]
        if _streams(c) and stream_depth > 1
    ]
    if w.parallel.weight_shards > 1:
        # FSDP2 owns the weights' placement: streaming them is refused (parallel/compat.py).
        out = [(name, c) for name, c in out if not _streams(c)]
    return out


def _workload(
    model,
    seq_len: int,
    batch: int,
    lora_rank: int,
    layers: int | None,
    dtype_bytes: int,
    optimizer_precision: str = "params",
    optimizer: OptimizerSetup | None = None,
    parallel: Parallelism | None = None,
) -> Workload:
    if optimizer_precision not in OPTIMIZER_STATE_BYTES:
        names = ", ".join(OPTIMIZER_STATE_BYTES)
        raise ValueError(f"optimizer_precision={optimizer_precision!r} is not a precision; use one of {names}")
    if seq_len < 1 or batch < 1:
        raise ValueError(f"seq_len={seq_len!r} and batch={batch!r} must be >= 1")
    if lora_rank < 0:
        raise ValueError(f"lora_rank={lora_rank!r} must be >= 0 (0: full fine-tune)")
    shape = model if isinstance(model, ModelShape) and layers is None else resolve_shape(model, layers)
    updates_in_backward = (optimizer or OptimizerSetup()).updates_in_backward
    return Workload(
        shape,
        seq_len,
        batch,
        lora_rank,
        dtype_bytes,
        optimizer_precision=optimizer_precision,
        updates_in_backward=updates_in_backward,
        parallel=parallel or Parallelism(),
    )


def plan(
    model,
    seq_len: int,
    *,
    batch: int = 1,
    lora_rank: int = 16,
    budgets: Budgets | None = None,
    layers: int | None = None,
    dtype_bytes: int = 2,
    stream_depth: int = STREAM_DEPTH,
    optimizer_precision: str = "params",
    optimizer: OptimizerSetup | None = None,
    parallel: Parallelism | None = None,
    fused_lora: bool = False,
    options: tuple[Options, ...] = (),
) -> Plan:
    """Choose the components' options for one step and predict its cost.

    Args:
        model: a shape name, model directory, config (dict or object), model or :class:`ModelShape`.
        seq_len / batch: tokens per row, rows.
        lora_rank: LoRA rank on every linear layer; 0 for a full fine-tune.
        budgets: what may be used (default: read from this machine).
        layers: override the depth.
        dtype_bytes: 2 for bf16/fp16 weights and activations.
        stream_depth: layers resident when streaming.
        optimizer_precision: a full fine-tune's AdamW state: "params", "fp32_master" or "compact".
        optimizer: whether a full fine-tune's optimizer may keep its state in host memory,
            and when it updates (None: :class:`OptimizerSetup`'s defaults: replaceable, the
            Trainer's clipping).
        parallel: the run's ranks (None: one GPU). The plan is one rank's: with
            ``context_parallel`` it holds ``seq_len / world_size`` tokens of each row
            (``seq_len``, a multiple of ``2 x world_size``, is the whole sequence). ``budgets``
            are this rank's; read here, they are its share of the host's.
        fused_lora: the LoRA layers run fused in the compute dtype (``fused_lora: true``):
            every candidate counts what they save instead of PEFT's fp32 input copies.
        options: the options of components the planner does not choose, as the run sets
            them: each one's footprint is counted, and the plan's config keeps them.

    Returns:
        The fastest :class:`Plan` that fits, or the most frugal one with ``fits=False``.

    Example:
        >>> p = plan("llama-3-8b", 65536, budgets=Budgets(79 << 30, 100 << 30, 60 << 30))
        >>> p.fits, p.to_config()["chunked_cross_entropy"]
        (True, True)
    """
    optimizer = optimizer or OptimizerSetup()
    w = _workload(model, seq_len, batch, lora_rank, layers, dtype_bytes, optimizer_precision, optimizer, parallel)
    b = budgets if budgets is not None else Budgets.detect(ranks_per_host=parallel.ranks_per_host if parallel else None)
    results = []
    # Only what the run can realise: an optimizer that cannot be replaced keeps its state.
    given = (LoraOptions(fused=True if fused_lora and w.lora_rank else None), *options)
    for name, c in _candidates(w, b, stream_depth, optimizer.replaceable, given):
        if w.parallel.splits_sequence:
            results.append(_with_rotation(w, b, name, c, optimizer))
        else:
            results.append(_realise(w, b, name, c, optimizer))
    fitting = [p for p in results if p.fits]
    if fitting:
        # Equal times (small workloads round to the same hundredth): the optimizer state and
        # the weights on the GPU and coarser tiles (moving state costs host RAM, and tiny tiles cost kernel
        # launches the estimate does not see), then the lower GPU peak.
        best = min(
            fitting,
            key=lambda p: (
                round(p.time.seconds, 2),
                option(p.options, OptimizerOptions).enabled,
                _streams(p.options) and not w.lora_rank,  # trainable weights cost host RAM
                long_context_counts(option(p.options, LongContextOptions))[1],
                long_context_counts(option(p.options, LongContextOptions))[0],
                p.memory.gpu_peak,
            ),
        )
    else:
        best = min(results, key=lambda p: p.memory.gpu_reserved)
    # Listed: what did not fit, and what fit and was estimated faster but lost the tie at the
    # hundredth to a plan that moves less state or tiles less finely.
    tie = "as fast to 0.01 s; the chosen plan keeps more on the GPU or tiles less finely"
    best.rejected = [
        (p.name, "; ".join(p.reasons) or tie)
        for p in results
        if p is not best and (not p.fits or p.time.seconds < best.time.seconds)
    ]
    return best


def _realise(w: Workload, b: Budgets, name: str, c: Choice, optimizer: OptimizerSetup) -> Plan:
    """One candidate made to fit where it can: a shorter prefetch horizon, block inputs held on
    the GPU, dropped or with their attention outputs kept, as each helps."""
    m = estimate_memory(w, c)
    t = estimate_time(w, c, b.rates, m.block_placement)
    reasons = _check(w, m, b)
    for shorter in _shorter_horizons(w, c, m, t, b) if reasons else ():
        # Fewer block inputs in flight: first the fewest that still hide each fetch behind
        # the layers of backward ahead, then none (each fetch waited for).
        c = with_options(c, ActivationOptions, loading_horizon=shorter)
        c = _placed(w, c, b, *input_counts(w, c))  # fewer staging buffers: more room in RAM
        m = estimate_memory(w, c)
        t = estimate_time(w, c, b.rates, m.block_placement)
        reasons = _check(w, m, b)
        if not reasons:
            break
    offload = option(c, ActivationOptions).mode is not False
    held = _gpu_blocks(w, m, b) if offload and (reasons or "disk" in m.block_placement) else 0
    if held:
        # RAM and disk are short but the GPU has room: it holds the newest block inputs.
        c = _placed(w, c, b, held, input_counts(w, c)[1])
        m = estimate_memory(w, c)
        t = estimate_time(w, c, b.rates, m.block_placement)
        reasons = _check(w, m, b)
    # Not under FSDP2: replaying blocks it shards is refused (parallel/compat.py).
    replayable = w.parallel.weight_shards == 1
    checkpointing = option(c, CheckpointOptions).enabled
    if replayable and offload and checkpointing and (reasons or "disk" in m.block_placement):
        dropped = _drop_inputs(w, c, b, m, t)
        if dropped is not None:
            c, m, t = dropped
            reasons = _check(w, m, b)
    if not reasons:
        kept = _keep_attention(w, c, b, t)
        if kept is not None:
            c, m, t = kept
    gpu_blocks, recompute_blocks = input_counts(w, c)
    if gpu_blocks:
        name += f", {gpu_blocks} block inputs on the GPU"
    if recompute_blocks:
        name += f", {recompute_blocks} block inputs recomputed"
    keep = keeps_attention(w, OptionSet(c))
    if keep:
        name += f", attention outputs of {keep} layers kept"
    return Plan(w, c, b, name, m, t, not reasons, reasons, optimizer=optimizer, ram_blocks=_ram_blocks(w, c, b))


def _with_rotation(w: Workload, b: Budgets, name: str, c: Choice, optimizer: OptimizerSetup) -> Plan:
    """One candidate over ranks splitting the sequence, with the ring's rotation: the run's
    when it fixes one; else all-gather where it fits and is as fast (to 0.01 s), all-to-all
    where it does not fit (all-to-all holds one neighbour's keys and values at a time, not the
    whole sequence's) or, on a slow link, hides more of the traffic."""
    first, *others = w.parallel.rotations
    p = _realise(w, b, name, with_options(c, ParallelOptions, rotation=first), optimizer)
    if not others:
        p.rotation_note = "as the run sets it"
        return p
    q = _realise(w, b, name, with_options(c, ParallelOptions, rotation=others[0]), optimizer)
    if p.fits and (not q.fits or round(p.time.seconds, 2) <= round(q.time.seconds, 2)):
        p.rotation_note = "all-gather fits"
        return p
    if p.fits:
        q.rotation_note = f"faster here: {q.time.seconds:.2f} s a step, all-gather {p.time.seconds:.2f} s"
    else:
        q.rotation_note = "all-gather does not fit: " + "; ".join(p.reasons)
    return q


def _keep_attention(w: Workload, c: Choice, b: Budgets, t: StepTime):
    """Attention outputs kept in host RAM for the recompute, for as many layers as RAM holds
    beside the block inputs (none on disk, none dropped: replayed runs recompute their blocks
    anyway), where the attention forward saved outweighs the copies.

    Returns:
        ``(options, memory, time)`` with ``keep_attention`` set, or None.
    """
    if not offloads_inputs(OptionSet(c)) or input_counts(w, c)[1]:
        return None
    m = estimate_memory(w, c)
    if "disk" in m.block_placement:
        return None
    room = b.host_bytes + HOST_BASELINE_BYTES - m.host
    layers = min(w.shape.layers, max(0, room) // max(1, attention_kept_bytes(w)))
    if layers <= 0:
        return None
    # Kept outputs add host bytes only, and ``room`` holds them: the plan fits as it did.
    g = with_options(c, CheckpointOptions, keep_attention=True if layers >= w.shape.layers else layers)
    gm = estimate_memory(w, g)
    if _check(w, gm, b):
        return None
    gt = estimate_time(w, g, b.rates, gm.block_placement)
    return (g, gm, gt) if gt.seconds < t.seconds else None


def _drop_inputs(w: Workload, c: Choice, b: Budgets, m: MemoryEstimate, t: StepTime):
    """The recompute placement: the fewest block inputs dropped (kept nowhere, replayed in
    backward from the kept input before them) that let RAM and disk hold the rest, or more,
    up to none left on disk, where replaying a block costs less than moving its input. Block
    inputs the GPU holds come first (they cost nothing); each one a longer replayed run pushes
    off the GPU is dropped instead.

    Storage need falls as drops rise and the GPU's need grows, so each count is found by
    bisection: a few estimates per candidate plan, not one per count.

    Returns:
        ``(options, memory, time)`` of the fastest variant that fits, or None (the plan as it
        is, when it fits and no drop is faster, or when no number of drops fits).
    """
    best = None if _check(w, m, b) else (t.seconds, c, m, t)

    def variant(held: int, drops: int):
        g = _placed(w, c, b, held, drops)
        gm = estimate_memory(w, g)
        return g, gm, _check(w, gm, b)

    def storage_short(held: int, drops: int) -> bool:
        return any("GPU" not in r for r in variant(held, drops)[2])

    def on_disk(held: int, drops: int) -> bool:
        return "disk" in variant(held, drops)[1].block_placement

    def first(pred, held: int, lo: int, hi: int) -> int:
        """The smallest ``d`` in [lo, hi] with ``pred(held, d)`` (monotone in ``d``), else hi + 1."""
        while lo <= hi:
            mid = (lo + hi) // 2
            if pred(held, mid):
                hi = mid - 1
            else:
                lo = mid + 1
        return lo

    for held in range(input_counts(w, c)[0], -1, -1):
        most = w.shape.layers - 2 - held  # block 0's input is always kept
        if most < 1:
            continue
        if storage_short(held, most):
            break  # holding fewer on the GPU only needs more storage
        fewest = first(lambda h, d: not storage_short(h, d), held, 1, most)
        no_disk = first(lambda h, d: not on_disk(h, d), held, fewest, most)
        span = min(no_disk, most) - fewest
        tried = sorted({fewest, min(no_disk, most), *range(fewest, fewest + span + 1, max(1, span // 6))})
        for drops in tried:
            g, gm, reasons = variant(held, drops)
            if reasons:
                break  # the GPU: more drops only lengthen the replayed runs
            gt = estimate_time(w, g, b.rates, gm.block_placement)
            if best is None or gt.seconds < best[0]:
                best = (gt.seconds, g, gm, gt)
        if best is not None and best[1] is not c:
            return best[1], best[2], best[3]
    return None


def _gpu_blocks(w: Workload, m: MemoryEstimate, b: Budgets) -> int:
    """How many more block inputs the GPU's room beside the predicted peak holds (counted at
    the allocator's reservation), up to every offloaded one."""
    room = b.gpu_bytes - m.gpu_reserved
    per = math.ceil(w.block_input_bytes * FRAGMENTATION)
    offloaded = m.block_placement.count("ram") + m.block_placement.count("disk")
    return max(0, min(offloaded, room // per)) if room > 0 else 0


def _shorter_horizons(w: Workload, c: Choice, m: MemoryEstimate, t, b: Budgets) -> list[int]:
    """Prefetch horizons below the engine's default to try when the step does not fit: the
    smallest that still hides a block input's fetch behind the backward of the layers ahead
    of it, then 0."""
    if not offloads_inputs(OptionSet(c)) or option(c, ActivationOptions).loading_horizon is not None:
        return []
    from_disk = "disk" in m.block_placement
    default = default_horizon(from_disk, option(c, OptimizerOptions).enabled and w.updates_in_backward)
    rate = b.rates.disk_read_bytes_per_s if from_disk else b.rates.pcie_bytes_per_s
    layer_backward_s = max(t.compute_s / 2 / w.shape.layers, 1e-9)  # about half the compute is backward
    needed = max(1, math.ceil(w.block_input_bytes / rate / layer_backward_s))
    return ([needed] if needed < default else []) + [0]
