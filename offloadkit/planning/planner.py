"""The planner: for a model, a sequence length and the machine's budgets, which features to
turn on, where each block input goes (GPU, pinned RAM, disk), the loss chunking and MLP
tiling, and the predicted peak, host and disk bytes and step time; and the longest
sequence that fits, beside the longest the budgets physically allow.

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
from dataclasses import dataclass, field, replace

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.defaults import OPTIMIZER_STATE_BYTES, STREAM_DEPTH
from offloadkit.engine.options import ActivationOptions
from offloadkit.layers.options import StreamingOptions
from offloadkit.longctx.options import LongContextOptions
from offloadkit.lora.options import LoraOptions
from offloadkit.optim.footprint import optimizer_footprint
from offloadkit.optim.options import OptimizerOptions
from offloadkit.parallel.options import ParallelOptions
from offloadkit.planning.budgets import Budgets
from offloadkit.planning.memory import (
    FRAGMENTATION,
    HORIZON_DISK,
    HORIZON_RAM,
    HOST_BASELINE_BYTES,
    Features,
    MemoryEstimate,
    Workload,
    attention_kept_bytes,
    auto_loss_chunks,
    auto_mlp_shards,
    estimate_memory,
    final_norm_bytes,
    region_length,
    streams_weights,
    tiered_reserve_bytes,
    tiles_projections,
)
from offloadkit.planning.parallelism import Parallelism, ring_rotation, rotation_name, search_step
from offloadkit.planning.shape import ModelShape, resolve_shape
from offloadkit.planning.timing import StepTime, estimate_time
from offloadkit.storage.options import BudgetOptions
from offloadkit.storage.pool import size_class

__all__ = ["Plan", "plan", "longest_sequence", "physical_limit", "Capacity", "OptimizerSetup", "SEQ_STEP"]

GiB = float(1 << 30)
# Sequence lengths are searched in multiples of this (kernels prefer aligned lengths).
SEQ_STEP = 1024


@dataclass(frozen=True)
class OptimizerSetup:
    """What a full fine-tune's optimizer lets the plan assume.

    Attributes:
        replaceable: the run's optimizer may be replaced by BackwardAdamW (or BackwardSGD),
            whose state lives in host memory, so the plan may offer that (the Trainer's own
            AdamW or SGD). False: the state stays where the run's optimizer keeps it (one
            passed to the Trainer, Adafactor, 8-bit Adam, ...), counted as AdamW's on the GPU.
        updates_in_backward: with the state in host memory, each parameter is updated in
            backward and its gradient freed at once. False, the Trainer's default
            (``max_grad_norm=1.0``): clipping, fp16 loss scaling or gradient accumulation
            defer the updates to ``step()``, and every gradient is held until then.
        source: where this was read from, for the plan's table.

    Example:
        >>> OptimizerSetup(updates_in_backward=True, source="max_grad_norm=0").updates_in_backward
        True
    """

    replaceable: bool = True
    updates_in_backward: bool = False
    source: str = "assumed: the Trainer's default max_grad_norm=1.0"

    def describe(self) -> str:
        """When the updates happen (or that the state cannot move), and why that was assumed."""
        if not self.replaceable:
            when = "not replaceable, state on the GPU"
        elif self.updates_in_backward:
            when = "updated in backward, one gradient held at a time"
        else:
            when = "updates at step(), every gradient held until then"
        return f"{when} ({self.source})"


@dataclass
class Plan:
    """What to do for one step, and what it is predicted to cost.

    Attributes:
        workload / features / budgets: the inputs and the chosen features.
        name: the chosen candidate.
        memory / time: predictions.
        fits: whether every budget holds.
        reasons: why it does not fit (empty when it does).
        rejected: the faster candidates that did not fit, with why.
        optimizer: what was assumed of a full fine-tune's optimizer.
        rotation_note: with a sequence split over ranks, why the rotation (:attr:`rotation`)
            was taken.
    """

    workload: Workload
    features: Features
    budgets: Budgets
    name: str
    memory: MemoryEstimate
    time: StepTime
    fits: bool
    reasons: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    optimizer: OptimizerSetup = field(default_factory=OptimizerSetup)
    rotation_note: str = ""

    @property
    def rotation(self) -> str | None:
        """How ring attention moves keys and values in this plan, "allgather" or "alltoall"
        (``apply_context_parallel(model, mesh, rotation=plan.rotation)``); None without a
        sequence split over ranks."""
        par = self.workload.parallel
        return ring_rotation(par, self.features.rotation) if par.splits_sequence else None

    @property
    def placement(self) -> list[str]:
        """Per layer: where its input waits for backward ("gpu", "ram" or "disk"), or
        "recompute" (kept nowhere, replayed from the kept input before it); every layer's
        inner activations are recomputed."""
        return self.memory.block_placement

    def host_budget_bytes(self) -> int | None:
        """``host_budget_bytes`` that realises the RAM share (streamed weights included: they
        share the budget), or None when nothing spills to disk."""
        if "disk" not in self.placement:
            return None
        w, f = self.workload, self.features
        ram = self.placement.count("ram") * size_class(w.block_input_bytes) + _streamed_host_bytes(w, f)
        # The tiered tier keeps some of its cap free, demoting ahead of need; the disk tier's
        # staging buffers are reserved outside the cap (the plan's host figure counts them).
        return max(ram + tiered_reserve_bytes(ram), 1 << 20)

    def to_config(self) -> dict:
        """The :class:`~offloadkit.config.OffloadConfig` keys that realise this plan.

        Example:
            >>> from offloadkit.config import OffloadConfig
            >>> OffloadConfig.from_dict(plan("tiny", 512, budgets=Budgets(8 << 30, 8 << 30, 8 << 30)).to_config())
            ... # doctest: +ELLIPSIS
            OffloadConfig(...)
        """
        f = self.features
        out: dict = {
            **CheckpointOptions.config_keys(enabled=f.checkpointing),
            **StreamingOptions.config_keys(enabled=f.layer_streaming, depth=f.stream_depth),
            **LongContextOptions.config_keys(
                chunked_loss=f.loss_chunks > 0,
                tiled_mlp=f.mlp_shards > 1,
                loss_chunks=f.loss_chunks or None,
                mlp_shards=f.mlp_shards if f.mlp_shards > 1 else None,
            ),
            **ActivationOptions.config_keys(disk_tiering=False),
            **LongContextOptions.config_keys(tiled_projections=f.tiled_projections and f.mlp_shards > 1),
            **OptimizerOptions.config_keys(enabled=f.optimizer_offloading),
        }
        if f.head_groups > 1:
            out |= LongContextOptions.config_keys(head_groups=f.head_groups)
        if self.workload.parallel.context_parallel and self.workload.parallel.world_size > 1:
            # The rotation this plan counted; whether to split is the caller's (context_parallel).
            out |= ParallelOptions.config_keys(rotation=ring_rotation(self.workload.parallel, f.rotation))
        if f.keep_attention:
            every = f.keep_attention >= self.workload.shape.layers
            out |= CheckpointOptions.config_keys(keep_attention=True if every else f.keep_attention)
        if f.optimizer_offloading:
            out |= OptimizerOptions.config_keys(precision=self.workload.optimizer_precision)
        if f.fused_lora:
            out |= LoraOptions.config_keys(fused=True)
        if f.offload_inputs and f.horizon is not None:
            out |= ActivationOptions.config_keys(loading_horizon=f.horizon)
        if f.offload_inputs and f.checkpointing:
            # Where each block input waits, as planned: the engine realises it block by block.
            out |= CheckpointOptions.config_keys(block_input_placement=tuple(self.placement))
        if not f.offload_inputs:
            out |= ActivationOptions.config_keys(mode=False)
        elif "disk" not in self.placement:
            out |= ActivationOptions.config_keys(mode=True)
        else:
            out |= ActivationOptions.config_keys(mode="disk")
            if "ram" in self.placement:
                out |= ActivationOptions.config_keys(disk_tiering=True)
                out |= BudgetOptions.config_keys(host_budget_bytes=self.host_budget_bytes())
        return out

    def at_depth(self, layers: int) -> "Plan":
        """This plan realised on a model of ``layers`` decoder layers of the same shape (a
        reduced-depth run of a full-depth plan): the same tiling, streaming, prefetch horizon
        and optimizer placement, block inputs placed for that depth with the plan's longest
        replayed run where the depth allows, and memory, time and fit estimated again.

        Example:
            >>> p = plan("llama-3-8b", 131072, budgets=Budgets(79 << 30, 100 << 30, 60 << 30))
            >>> len(p.at_depth(2).to_config()["block_input_placement"])
            2
        """
        if layers == self.workload.shape.layers:
            return self
        w = replace(self.workload, shape=self.workload.shape.with_layers(layers))
        f = self.features
        f = replace(
            f,
            # The oldest block inputs stay offloaded where the plan offloads them; the GPU
            # holds no more of the newest than leave one to offload.
            gpu_blocks=min(f.gpu_blocks, max(0, layers - 2)),
            # A run of dropped inputs replays as many blocks as at full depth, where it fits.
            recompute_blocks=region_length(self.placement) - 1 if f.recompute_blocks else 0,
            keep_attention=min(f.keep_attention, layers),
        )
        m = estimate_memory(w, f)
        t = estimate_time(w, f, self.budgets.rates, m.block_placement)
        reasons = _check(w, m, self.budgets)
        name = f"{self.name}, at {layers} of its {self.workload.shape.layers} layers"
        return Plan(
            w,
            f,
            self.budgets,
            name,
            m,
            t,
            not reasons,
            reasons,
            optimizer=self.optimizer,
            rotation_note=self.rotation_note,
        )

    def table(self) -> str:
        """The plan as a text table."""
        w, m, t, b = self.workload, self.memory, self.time, self.budgets
        lora = f"LoRA r={w.lora_rank}" if w.lora_rank else "full fine-tune"
        runs = _runs(self.placement)
        par = w.parallel
        per_rank = ""
        if par.world_size > 1:
            per_rank = f" (per rank of {par.world_size}" + (
                f": {w.tokens} tokens each)" if par.splits_sequence else ")"
            )
        ring = f", ring {t.ring_s:.2f} s, {t.ring_wait_s:.2f} s of it waited for" if par.splits_sequence else ""
        link = b.rates.link_bytes_per_s if par.one_host else b.rates.network_bytes_per_s
        lines = [
            f"plan for {w.shape.name} ({w.shape.layers} layers), {w.seq_len} tokens x {w.batch}{per_rank}, {lora}: "
            f"{self.name}" + ("" if self.fits else "  ** DOES NOT FIT: " + "; ".join(self.reasons) + " **"),
            "",
            "| layers | block input | kept in |",
            "|---|---|---|",
        ]
        for (lo, hi), where in runs:
            if where == "recompute":
                where = "nowhere: replayed from the kept input before it"
            lines.append(f"| {lo}-{hi} | {w.block_input_bytes / GiB:.2f} GiB each | {where} |")
        f = self.features
        lines += [
            "",
            f"loss: {'chunked, ' + str(f.loss_chunks) + ' chunks' if f.loss_chunks else 'unchunked'};  "
            f"MLP: {str(f.mlp_shards) + ' shards' if f.mlp_shards > 1 else 'untiled'}"
            f"{' (norms and attention projections too)' if f.tiled_projections else ''};  "
            f"{'attention: ' + str(f.head_groups) + ' head groups;  ' if f.head_groups > 1 else ''}"
            f"{'ring attention: ' + rotation_name(self.rotation) + ' rotation;  ' if self.rotation else ''}"
            f"{'prefetch horizon: ' + str(f.horizon) + ';  ' if f.offload_inputs and f.horizon is not None else ''}"
            f"layer streaming: {'on, depth ' + str(f.stream_depth) if f.layer_streaming else 'off'}"
            + (
                ""
                if w.lora_rank
                else f";  AdamW state ({w.optimizer_precision}, {w.optimizer_state_bytes} bytes a parameter): "
                + ("host memory, " + self.optimizer.describe() if f.optimizer_offloading else "GPU")
            ),
            "",
            "| | predicted | budget |",
            "|---|---|---|",
            f"| GPU peak allocated | {m.gpu_peak / GiB:.2f} GiB ({m.phase}) | |",
            f"| GPU reserved | {m.gpu_reserved / GiB:.2f} GiB | {b.gpu_bytes / GiB:.2f} GiB |",
            f"| host RAM | {m.host / GiB:.2f} GiB (incl. {HOST_BASELINE_BYTES / GiB:.0f} GiB process) | "
            f"{b.host_bytes / GiB:.2f} GiB + process |",
            f"| disk | {m.disk / GiB:.2f} GiB | {b.disk_bytes / GiB:.2f} GiB |",
            f"| step time | {t.seconds:.2f} s ({t.bound}-bound; compute {t.compute_s:.2f} s, PCIe {t.pcie_s:.2f} s, "
            f"disk {t.disk_s:.2f} s{ring}"
            + (f", FSDP2 all-gathers and reduce-scatter {t.shard_s:.2f} s" if t.shard_s else "")
            + ") | |",
            f"| tokens/s, TFLOP/s | {w.tokens / t.seconds:.0f}, {t.flops / t.seconds / 1e12:.0f} | |",
            "",
            "GPU peak parts: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in m.gpu_parts.items()) + " GiB",
            f"rates ({b.rates.source}): matmul {b.rates.matmul_flops_per_s / 1e12:.0f} TFLOP/s, attention "
            f"{b.rates.attention_flops_per_s / 1e12:.0f} TFLOP/s, PCIe {b.rates.pcie_bytes_per_s / 1e9:.1f} GB/s, "
            f"disk write/read {b.rates.disk_write_bytes_per_s / 1e9:.2f}/"
            f"{b.rates.disk_read_bytes_per_s / 1e9:.2f} GB/s"
            + (
                f", ring {link / 1e9:.0f} GB/s ({'within a host' if par.one_host else 'between hosts'})" if ring else ""
            ),
        ]
        for name, why in self.rejected:
            lines.append(f"not chosen: {name}: {why}")
        return "\n".join(lines)


def _runs(placement: list[str]) -> list[tuple[tuple[int, int], str]]:
    runs: list[tuple[tuple[int, int], str]] = []
    for i, where in enumerate(placement):
        if runs and runs[-1][1] == where:
            runs[-1] = ((runs[-1][0][0], i), where)
        else:
            runs.append(((i, i), where))
    return runs


def _check(w: Workload, m: MemoryEstimate, b: Budgets) -> list[str]:
    reasons = []
    if m.gpu_reserved > b.gpu_bytes:
        reasons.append(f"GPU needs {m.gpu_reserved / GiB:.1f} GiB of {b.gpu_bytes / GiB:.1f}")
    if m.host - HOST_BASELINE_BYTES > b.host_bytes:
        reasons.append(f"host RAM needs {(m.host - HOST_BASELINE_BYTES) / GiB:.1f} GiB of {b.host_bytes / GiB:.1f}")
    if m.disk > b.disk_bytes:
        reasons.append(f"disk needs {m.disk / GiB:.1f} GiB of {b.disk_bytes / GiB:.1f}")
    return reasons


def _streamed_host_bytes(w: Workload, f: Features) -> int:
    """Host RAM of the streamed layers (they share the engine's host budget)."""
    if streams_weights(w, f):
        return w.shape.layers * size_class(w.shape.layer_params * w.dtype_bytes)
    return 0


def _held_host_bytes(w: Workload, f: Features) -> int:
    """Host RAM held beside the block inputs: the streamed layers, and a full fine-tune's
    AdamW state in host memory (the optimizer's own, outside the engine's budget)."""
    state = optimizer_footprint(w, f).host.get("optimizer state", 0)  # each rank's share under FSDP2
    return _streamed_host_bytes(w, f) + state


def _ram_blocks(w: Workload, f: Features, b: Budgets) -> int:
    """Block inputs the host budget holds beside the streamed weights; when the rest spill to
    disk, also beside the disk tier's staging buffers and the room the tiered tier keeps free
    (what the engine does with the cap :meth:`Plan.host_budget_bytes` gives it)."""
    streamed, state = _streamed_host_bytes(w, f), _held_host_bytes(w, f) - _streamed_host_bytes(w, f)
    room = b.host_bytes - streamed - state
    per = size_class(w.block_input_bytes)
    if room // per >= w.shape.layers - 1 - f.gpu_blocks - f.recompute_blocks:
        return max(0, room // per)  # nothing spills: no staging, no demotion
    horizon = f.horizon if f.horizon is not None else HORIZON_DISK
    staging = (horizon + 1) * per
    n = max(0, (room - staging) // per)
    # The cap (:meth:`Plan.host_budget_bytes`) covers the streamed weights too, and so does
    # the room the tiered tier keeps free under it.
    while n and n * per + streamed + tiered_reserve_bytes(n * per + streamed) + staging + state > b.host_bytes:
        n -= 1
    return n


# How much finer than the automatic tiling the planner tries when a step does not fit.
FINER_TILES = (2, 4, 8, 16, 32)


def _candidates(w: Workload, b: Budgets, stream_depth: int, state_movable: bool = True) -> list[tuple[str, Features]]:
    mlp_shards = auto_mlp_shards(w.tokens, w.shape.intermediate)
    base = Features(
        checkpointing=True,
        loss_chunks=auto_loss_chunks(w.tokens, w.shape.vocab),
        mlp_shards=mlp_shards,
        stream_depth=stream_depth,
    )
    offload = replace(base, offload_inputs=True)
    out = [
        ("checkpointing", base),
        ("checkpointing + block-input offload", replace(offload, ram_blocks=_ram_blocks(w, offload, b))),
    ]
    if not w.lora_rank and state_movable:
        # A full fine-tune's AdamW state in host memory (its gradients too, where the updates
        # run in backward); with it, the layers' weights can stream too.
        for name, f in list(out):
            out.append((name + " + optimizer state in host memory", replace(f, optimizer_offloading=True)))
        streamed = replace(offload, optimizer_offloading=True, layer_streaming=True)
        out.append(
            (
                "checkpointing + block-input offload + optimizer state in host memory + layer streaming",
                replace(streamed, ram_blocks=_ram_blocks(w, streamed, b)),
            )
        )
    if w.lora_rank:
        streamed = replace(offload, layer_streaming=True)
        out.append(
            (
                "checkpointing + block-input offload + layer streaming",
                replace(streamed, ram_blocks=_ram_blocks(w, streamed, b)),
            )
        )
    tiled = out
    out = []
    if mlp_shards > 1:
        # Tiling costs the tiled modules' forward once more: each variant is offered untiled
        # first, and plan() keeps the fastest that fits.
        out += [(name + " (MLP untiled)", replace(f, mlp_shards=1)) for name, f in tiled]
    out += tiled
    if mlp_shards > 1 and tiles_projections(w.tokens, w.shape.hidden):
        out += [
            (name + " + tiled projections", replace(f, tiled_projections=True, head_groups=w.shape.kv_heads))
            for name, f in tiled
        ]
    # Small GPUs: a layer's working set (the MLP's intermediate, the projections' outputs,
    # the logits of a loss chunk) shrinks with finer tiles, at the cost of more and smaller
    # kernels; offered last, so a GPU with room keeps the coarser tiles.
    for factor in FINER_TILES:
        out += [
            (
                f"{name} + tiled projections, {max(2, mlp_shards) * factor} shards",
                replace(
                    f,
                    mlp_shards=max(2, mlp_shards) * factor,
                    tiled_projections=True,
                    head_groups=w.shape.kv_heads,
                    loss_chunks=f.loss_chunks * factor,
                ),
            )
            for name, f in tiled
        ]
    # Last resort for the smallest GPUs: one streamed layer resident instead of two (its
    # weights' copy is then waited for, not overlapped).
    out += [
        (name + ", one streamed layer resident", replace(f, stream_depth=1))
        for name, f in out[-len(tiled) :]
        if f.layer_streaming and stream_depth > 1
    ]
    if w.parallel.weight_shards > 1:
        # FSDP2 owns the weights' placement: streaming them is refused (parallel/compat.py).
        out = [(name, f) for name, f in out if not f.layer_streaming]
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
) -> Plan:
    """Choose the features for one step and predict its cost.

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
    for name, f in _candidates(w, b, stream_depth, optimizer.replaceable):
        f = replace(f, fused_lora=fused_lora and bool(w.lora_rank))
        if w.parallel.splits_sequence:
            results.append(_with_rotation(w, b, name, f, optimizer))
        else:
            results.append(_realise(w, b, name, f, optimizer))
    fitting = [p for p in results if p.fits]
    if fitting:
        # Equal times (small workloads round to the same hundredth): the optimizer state and
        # the weights on the GPU and coarser tiles (moving state costs host RAM, and tiny tiles cost kernel
        # launches the estimate does not see), then the lower GPU peak.
        best = min(
            fitting,
            key=lambda p: (
                round(p.time.seconds, 2),
                p.features.optimizer_offloading,
                p.features.layer_streaming and not w.lora_rank,  # trainable weights cost host RAM
                p.features.mlp_shards,
                p.features.loss_chunks,
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


def _realise(w: Workload, b: Budgets, name: str, f: Features, optimizer: OptimizerSetup) -> Plan:
    """One candidate made to fit where it can: a shorter prefetch horizon, block inputs held on
    the GPU, dropped or with their attention outputs kept, as each helps."""
    m = estimate_memory(w, f)
    t = estimate_time(w, f, b.rates, m.block_placement)
    reasons = _check(w, m, b)
    for shorter in _shorter_horizons(w, f, m, t, b) if reasons else ():
        # Fewer block inputs in flight: first the fewest that still hide each fetch behind
        # the layers of backward ahead, then none (each fetch waited for).
        f = replace(f, horizon=shorter)
        f = replace(f, ram_blocks=_ram_blocks(w, f, b))  # fewer staging buffers: more room in RAM
        m = estimate_memory(w, f)
        t = estimate_time(w, f, b.rates, m.block_placement)
        reasons = _check(w, m, b)
        if not reasons:
            break
    held = _gpu_blocks(w, f, m, b) if f.offload_inputs and (reasons or "disk" in m.block_placement) else 0
    if held:
        # RAM and disk are short but the GPU has room: it holds the newest block inputs.
        f = replace(f, gpu_blocks=held)
        f = replace(f, ram_blocks=_ram_blocks(w, f, b))
        m = estimate_memory(w, f)
        t = estimate_time(w, f, b.rates, m.block_placement)
        reasons = _check(w, m, b)
    # Not under FSDP2: replaying blocks it shards is refused (parallel/compat.py).
    replayable = w.parallel.weight_shards == 1
    if replayable and f.offload_inputs and f.checkpointing and (reasons or "disk" in m.block_placement):
        dropped = _drop_inputs(w, f, b, m, t)
        if dropped is not None:
            f, m, t = dropped
            reasons = _check(w, m, b)
    if not reasons:
        kept = _keep_attention(w, f, b, t)
        if kept is not None:
            f, m, t = kept
    if f.gpu_blocks:
        name += f", {f.gpu_blocks} block inputs on the GPU"
    if f.recompute_blocks:
        name += f", {f.recompute_blocks} block inputs recomputed"
    if f.keep_attention:
        name += f", attention outputs of {f.keep_attention} layers kept"
    return Plan(w, f, b, name, m, t, not reasons, reasons, optimizer=optimizer)


def _with_rotation(w: Workload, b: Budgets, name: str, f: Features, optimizer: OptimizerSetup) -> Plan:
    """One candidate over ranks splitting the sequence, with the ring's rotation: the run's
    when it fixes one; else all-gather where it fits and is as fast (to 0.01 s), all-to-all
    where it does not fit (all-to-all holds one neighbour's keys and values at a time, not the
    whole sequence's) or, on a slow link, hides more of the traffic."""
    first, *others = w.parallel.rotations
    p = _realise(w, b, name, replace(f, rotation=first), optimizer)
    if not others:
        p.rotation_note = "as the run sets it"
        return p
    q = _realise(w, b, name, replace(f, rotation=others[0]), optimizer)
    if p.fits and (not q.fits or round(p.time.seconds, 2) <= round(q.time.seconds, 2)):
        p.rotation_note = "all-gather fits"
        return p
    if p.fits:
        q.rotation_note = f"faster here: {q.time.seconds:.2f} s a step, all-gather {p.time.seconds:.2f} s"
    else:
        q.rotation_note = "all-gather does not fit: " + "; ".join(p.reasons)
    return q


def _keep_attention(w: Workload, f: Features, b: Budgets, t: StepTime):
    """Attention outputs kept in host RAM for the recompute, for as many layers as RAM holds
    beside the block inputs (none on disk, none dropped: replayed runs recompute their blocks
    anyway), where the attention forward saved outweighs the copies.

    Returns:
        ``(features, memory, time)`` with ``keep_attention`` > 0, or None.
    """
    if not (f.checkpointing and f.offload_inputs) or f.recompute_blocks:
        return None
    m = estimate_memory(w, f)
    if "disk" in m.block_placement:
        return None
    room = b.host_bytes + HOST_BASELINE_BYTES - m.host
    layers = min(w.shape.layers, max(0, room) // max(1, attention_kept_bytes(w)))
    if layers <= 0:
        return None
    # Kept outputs add host bytes only, and ``room`` holds them: the plan fits as it did.
    g = replace(f, keep_attention=layers)
    gm = estimate_memory(w, g)
    if _check(w, gm, b):
        return None
    gt = estimate_time(w, g, b.rates, gm.block_placement)
    return (g, gm, gt) if gt.seconds < t.seconds else None


def _drop_inputs(w: Workload, f: Features, b: Budgets, m: MemoryEstimate, t: StepTime):
    """The recompute placement: the fewest block inputs dropped (kept nowhere, replayed in
    backward from the kept input before them) that let RAM and disk hold the rest, or more,
    up to none left on disk, where replaying a block costs less than moving its input. Block
    inputs the GPU holds come first (they cost nothing); each one a longer replayed run pushes
    off the GPU is dropped instead.

    Storage need falls as drops rise and the GPU's need grows, so each count is found by
    bisection: a few estimates per candidate plan, not one per count.

    Returns:
        ``(features, memory, time)`` of the fastest variant that fits, or None (the plan as it
        is, when it fits and no drop is faster, or when no number of drops fits).
    """
    best = None if _check(w, m, b) else (t.seconds, f, m, t)

    def variant(held: int, drops: int):
        g = replace(f, gpu_blocks=held, recompute_blocks=drops)
        g = replace(g, ram_blocks=_ram_blocks(w, g, b))
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

    for held in range(f.gpu_blocks, -1, -1):
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
        if best is not None and best[1] is not f:
            return best[1], best[2], best[3]
    return None


def _gpu_blocks(w: Workload, f: Features, m: MemoryEstimate, b: Budgets) -> int:
    """How many more block inputs the GPU's room beside the predicted peak holds (counted at
    the allocator's reservation), up to every offloaded one."""
    room = b.gpu_bytes - m.gpu_reserved
    per = math.ceil(w.block_input_bytes * FRAGMENTATION)
    offloaded = m.block_placement.count("ram") + m.block_placement.count("disk")
    return max(0, min(offloaded, room // per)) if room > 0 else 0


def _shorter_horizons(w: Workload, f: Features, m: MemoryEstimate, t, b: Budgets) -> list[int]:
    """Prefetch horizons below the engine's default to try when the step does not fit: the
    smallest that still hides a block input's fetch behind the backward of the layers ahead
    of it, then 0."""
    if not (f.checkpointing and f.offload_inputs) or f.horizon is not None:
        return []
    from_disk = "disk" in m.block_placement
    default = HORIZON_DISK if from_disk else HORIZON_RAM
    rate = b.rates.disk_read_bytes_per_s if from_disk else b.rates.pcie_bytes_per_s
    layer_backward_s = max(t.compute_s / 2 / w.shape.layers, 1e-9)  # about half the compute is backward
    needed = max(1, math.ceil(w.block_input_bytes / rate / layer_backward_s))
    return ([needed] if needed < default else []) + [0]


@dataclass
class Capacity:
    """The longest sequence the plan fits, beside what the budgets physically allow.

    Attributes:
        longest: longest ``seq_len`` (multiple of :data:`SEQ_STEP`) for which :func:`plan` fits.
        physical: longest for which the irreducible bytes fit (:func:`physical_limit`): one
            layer's recompute and backward with one-token tiles, the resident edge weights and
            two streamed layers on the GPU, and, together with them, every block input and
            streamed weight somewhere on GPU, RAM or disk.
        plan: the plan at ``longest`` (None when even :data:`SEQ_STEP` does not fit).
        limit: what stops ``physical`` ("gpu" or "storage").
        parallel: the ranks planned for; split over them, both lengths are the whole sequence's.
    """

    longest: int
    physical: int
    plan: Plan | None
    limit: str
    parallel: Parallelism = Parallelism()

    @property
    def ratio(self) -> float:
        return self.longest / self.physical if self.physical else 0.0

    def summary(self) -> str:
        ranks = self.parallel.sequence_ranks
        across = f" across {ranks} ranks ({self.longest // ranks} each)" if ranks > 1 else ""
        return (
            f"longest sequence that fits: {self.longest} tokens{across}; physically allowed by the budgets: "
            f"{self.physical} tokens ({self.limit}-limited); reached {self.ratio:.0%}"
        )


def _search(fits, high: int, step: int = SEQ_STEP) -> int:
    lo, hi = 0, max(1, high // step)
    while fits(hi * step) and hi < (1 << 40) // step:  # grow past the guess if it fits
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step


def physical_limit(
    model,
    *,
    batch: int = 1,
    lora_rank: int = 16,
    budgets: Budgets,
    layers: int | None = None,
    dtype_bytes: int = 2,
    optimizer_precision: str = "params",
    optimizer: OptimizerSetup | None = None,
    parallel: Parallelism | None = None,
) -> tuple[int, str]:
    """Longest sequence whose irreducible bytes fit the budgets (see :class:`Capacity`), and
    what limits it.

    Two conditions. The working set of the GPU's largest moment (one layer's recompute and
    backward with one-token tiles, the resident weights, the last block input, nothing
    fetched ahead, no allocator overhead) must fit the GPU alone ("gpu"). And everything
    alive at that moment, the working set plus the other kept block inputs and the streamed
    weights, must fit GPU, RAM and disk together ("storage"): a byte held on the GPU is not
    also free for block inputs. Block inputs may be dropped and recomputed (one kept input
    replays the run after it): each drop frees storage and lengthens a run, whose replayed
    inputs the GPU holds beside the working set; storage is short only when no number of
    drops fits both. Split over ranks (``parallel``), the lengths are the whole sequence's and
    the budgets one rank's, and ring attention rotates all-to-all where the run allows it (the
    lighter rotation).
    """
    parallel = parallel or Parallelism()
    step = search_step(parallel, SEQ_STEP)
    w0 = _workload(model, step, batch, lora_rank, layers, dtype_bytes, optimizer_precision, optimizer, parallel)
    pooled = budgets.gpu_bytes + budgets.host_bytes + budgets.disk_bytes
    # A full fine-tune's AdamW state lives in host RAM where RAM holds it, and the optimizer
    # can be replaced by one that keeps it there.
    state = 0 if lora_rank else -(-w0.shape.params // parallel.weight_shards) * w0.optimizer_state_bytes
    movable = (optimizer or OptimizerSetup()).replaceable
    state_on_host = bool(state) and movable and state <= budgets.host_bytes
    # Streamed weights (frozen, or trainable ones whose state is in host RAM) live in host RAM
    # beside the state; where RAM cannot hold them they stay on the GPU.
    streamed = w0.shape.layers * w0.shape.layer_params * w0.dtype_bytes
    streaming = (bool(lora_rank) or state_on_host) and streamed + (state if state_on_host else 0) <= budgets.host_bytes
    # FSDP2 owns the weights: it streams none and replays no block (both refused under it).
    sharded = parallel.weight_shards > 1
    streaming = streaming and not sharded

    # Ring attention's lighter rotation where the run allows it: one neighbour's keys and values at a time.
    lightest = parallel.rotations[-1]

    def working_set(seq: int, drops: int = 0):
        w = replace(w0, seq_len=seq)
        f = Features(
            checkpointing=True,
            offload_inputs=True,
            layer_streaming=streaming,
            horizon=0,
            loss_chunks=max(1, w.tokens),
            mlp_shards=max(1, w.tokens),
            tiled_projections=True,
            head_groups=w.shape.kv_heads,
            optimizer_offloading=state_on_host,
            recompute_blocks=drops,
            rotation=lightest,
        )
        return w, estimate_memory(w, f).gpu_peak

    def gpu_ok(seq: int) -> bool:
        return working_set(seq)[1] <= budgets.gpu_bytes

    off_gpu = (streamed if streaming else 0) + (state if state_on_host else 0)

    def storage_ok(seq: int) -> bool:
        # Dropped block inputs take no storage; the runs they lengthen are replayed on the GPU.
        for drops in range(1 if sharded else max(1, w0.shape.layers - 1)):
            w, gpu = working_set(seq, drops)
            if gpu > budgets.gpu_bytes:
                return False
            kept = (w.shape.layers - 1 - drops) * w.block_input_bytes + final_norm_bytes(w, tiled=True)
            if gpu + kept + off_gpu <= pooled:
                return True
        return False

    guess = (1 << 16) * parallel.sequence_ranks
    by_gpu = _search(gpu_ok, guess, step)
    by_storage = _search(storage_ok, guess, step)
    return (by_gpu, "gpu") if by_gpu <= by_storage else (by_storage, "storage")


def longest_sequence(
    model,
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
) -> Capacity:
    """Binary search for the longest sequence :func:`plan` fits under ``budgets`` (split over
    ranks, ``parallel``: the whole sequence, in multiples of ``2 x world_size`` too).

    Example:
        >>> cap = longest_sequence("llama-3-8b", budgets=Budgets(79 << 30, 100 << 30, 60 << 30))
        >>> cap.longest <= cap.physical
        True
    """
    b = budgets if budgets is not None else Budgets.detect(ranks_per_host=parallel.ranks_per_host if parallel else None)
    parallel = parallel or Parallelism()

    def fits(seq: int) -> bool:
        return plan(
            model,
            seq,
            batch=batch,
            lora_rank=lora_rank,
            budgets=b,
            layers=layers,
            dtype_bytes=dtype_bytes,
            stream_depth=stream_depth,
            optimizer_precision=optimizer_precision,
            optimizer=optimizer,
            parallel=parallel,
            fused_lora=fused_lora,
        ).fits

    longest = _search(fits, (1 << 16) * parallel.sequence_ranks, search_step(parallel, SEQ_STEP))
    physical, limit = physical_limit(
        model,
        batch=batch,
        lora_rank=lora_rank,
        budgets=b,
        layers=layers,
        dtype_bytes=dtype_bytes,
        optimizer_precision=optimizer_precision,
        optimizer=optimizer,
        parallel=parallel,
    )
    best = (
        plan(
            model,
            longest,
            batch=batch,
            lora_rank=lora_rank,
            budgets=b,
            layers=layers,
            dtype_bytes=dtype_bytes,
            stream_depth=stream_depth,
            optimizer_precision=optimizer_precision,
            optimizer=optimizer,
            parallel=parallel,
            fused_lora=fused_lora,
        )
        if longest
        else None
    )
    return Capacity(longest, max(physical, longest), best, limit, parallel)
