"""A plan: the components' options the planner chose for one step (:attr:`Plan.options`),
where each block input waits, the predicted GPU, host and disk bytes and step time, the config
keys that realise it (:meth:`Plan.to_config`: each options class writes its own), the same
plan at another depth, and the table and verdict the CLI prints.
:mod:`~offloadkit.planning.planner` searches for it, over options: :func:`planned_options`
builds a candidate, :func:`with_options` edits one component's, :func:`place_inputs` places
block inputs by the planner's counts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import FootprintOptions, OptionSet
from offloadkit.engine.options import ActivationOptions
from offloadkit.layers.options import StreamingOptions
from offloadkit.longctx.footprint import tiled_mlp_shards
from offloadkit.longctx.options import LongContextOptions
from offloadkit.lora.options import LoraOptions
from offloadkit.optim.options import OptimizerOptions
from offloadkit.options import Options
from offloadkit.parallel.footprint import chosen_rotation
from offloadkit.parallel.options import ParallelOptions
from offloadkit.planning.budgets import Budgets
from offloadkit.planning.memory import (
    HOST_BASELINE_BYTES,
    PLANNED_OPTIONS,
    MemoryEstimate,
    OptionsT,
    Workload,
    block_placement,
    estimate_memory,
    long_context_options,
    placed_by_counts,
    region_length,
    streams_weights,
    tiered_reserve_bytes,
)
from offloadkit.planning.parallelism import ring_rotation, rotation_name
from offloadkit.planning.timing import StepTime, estimate_time
from offloadkit.storage.footprint import offloads_inputs
from offloadkit.storage.options import BudgetOptions
from offloadkit.storage.pool import size_class

__all__ = [
    "Choice",
    "OptimizerSetup",
    "Plan",
    "changed_fields",
    "input_counts",
    "option",
    "place_inputs",
    "planned_options",
    "with_options",
]

# A plan's choice: every planned component's options (in :data:`PLANNED_OPTIONS` order),
# then those of the components the run sets and the planner does not choose.
Choice = tuple[Options, ...]


def option(choice: Choice, cls: type[OptionsT]) -> OptionsT:
    """``cls``'s options in ``choice``, else its defaults."""
    return OptionSet(choice).of(cls)


def with_options(choice: Choice, cls: type[Options], **changes) -> Choice:
    """``choice`` with ``cls``'s options changed (``dataclasses.replace``: checked again)."""
    return tuple(replace(o, **changes) if type(o) is cls else o for o in choice)  # type: ignore[type-var]


def planned_options(
    w: Workload,
    *,
    loss_chunks: int = 0,
    mlp_shards: int = 1,
    tiled_projections: bool = False,
    head_groups: int = 1,
    offload_inputs: bool = False,
    layer_streaming: bool = False,
    stream_depth: int = StreamingOptions.default("depth"),
    optimizer_offloading: bool = False,
    fused_lora: bool = False,
    rotation: str = "auto",
    others: Choice = (),
) -> Choice:
    """A candidate's options: every layer checkpointed, with the given tiling, streaming,
    optimizer state and (unplaced: all in RAM, see :func:`place_inputs`) block-input
    offloading; ``others``: the options of components the planner does not choose, as the run
    sets them (a planned component's among them is left out).

    Example:
        >>> from offloadkit.planning.shape import resolve_shape
        >>> c = planned_options(Workload(resolve_shape("tiny"), 512), loss_chunks=2)
        >>> option(c, LongContextOptions).loss_chunks
        2
    """
    # The run's selective checkpointing stays (every candidate counts what it saves).
    selective = next((o.selective for o in others if type(o) is CheckpointOptions), None)
    return (
        CheckpointOptions(enabled=True, selective=selective),
        StreamingOptions(enabled=layer_streaming, depth=stream_depth),
        long_context_options(loss_chunks, mlp_shards, tiled_projections, head_groups),
        ActivationOptions(mode=offload_inputs),
        # The precision the state is moved in, with it moved (else the run's stands).
        OptimizerOptions(
            enabled=optimizer_offloading,
            precision=w.optimizer_precision if optimizer_offloading else OptimizerOptions.default("precision"),
        ),
        LoraOptions(fused=True if fused_lora else None),
        ParallelOptions(rotation=rotation),
        BudgetOptions(),
    ) + tuple(o for o in others if type(o) not in PLANNED_OPTIONS)


def place_inputs(
    w: Workload, choice: Choice, gpu_blocks: int = 0, recompute_blocks: int = 0, ram_blocks: int | None = None
) -> Choice:
    """``choice`` with block inputs placed by the planner's counts (:func:`placed_by_counts`)
    as ``block_input_placement``, and the engine's tier that holds them (RAM, disk, or tiered
    where they are split); without offloaded inputs, as it is."""
    o = OptionSet(choice)
    if not offloads_inputs(o):
        return choice
    placement = placed_by_counts(w.shape.layers, True, gpu_blocks, recompute_blocks, ram_blocks)
    choice = with_options(choice, CheckpointOptions, block_input_placement=tuple(placement))
    tiered = "disk" in placement and "ram" in placement
    return with_options(choice, ActivationOptions, mode="disk" if "disk" in placement else True, disk_tiering=tiered)


def input_counts(w: Workload, choice: FootprintOptions | Choice) -> tuple[int, int]:
    """(block inputs on the GPU besides the last, block inputs dropped) where ``choice``
    places them."""
    o = OptionSet(choice) if isinstance(choice, tuple) else choice
    if not offloads_inputs(o):
        return 0, 0
    placement = block_placement(w.shape.layers, o)
    return placement.count("gpu") - 1, placement.count("recompute")


# Fields a plan writes whatever their value: what it decides over the run's config (the
# rest of its options are written where they differ from their defaults).
_DECIDED: dict[type[Options], tuple[str, ...]] = {
    CheckpointOptions: ("enabled",),
    StreamingOptions: ("enabled", "depth"),
    LongContextOptions: ("chunked_loss", "tiled_mlp", "loss_chunks", "mlp_shards", "tiled_projections"),
    ActivationOptions: ("mode", "disk_tiering"),
    OptimizerOptions: ("enabled",),
}


def _decided(options: Options) -> tuple[str, ...]:
    if isinstance(options, OptimizerOptions) and options.enabled:
        return ("enabled", "precision")  # the precision the state is moved in
    return _DECIDED.get(type(options), ())


def changed_fields(options: Options) -> dict:
    """The fields of ``options`` a plan's config writes: those set by a config key that differ
    from their defaults, and those the plan decides whatever their value."""
    decided = _decided(options)
    keyed = set(options.keys().values())
    return {
        f.name: getattr(options, f.name)
        for f in dataclasses.fields(options)  # type: ignore[arg-type]
        if f.name in keyed and (f.name in decided or getattr(options, f.name) != f.default)
    }


GiB = float(1 << 30)


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
        workload / budgets: the inputs.
        options: the plan's choice as the components' options: every planned component's (in
            :data:`~offloadkit.planning.memory.PLANNED_OPTIONS` order), block inputs placed
            (``block_input_placement``) and the host budget that realises their RAM share,
            then those of the components it does not choose, as the run set them.
        name: the chosen candidate.
        memory / time: predictions.
        fits: whether every budget holds.
        reasons: why it does not fit (empty when it does).
        rejected: the faster candidates that did not fit, with why.
        optimizer: what was assumed of a full fine-tune's optimizer.
        rotation_note: with a sequence split over ranks, why the rotation (:attr:`rotation`)
            was taken.
        ram_blocks: the block inputs the host budget holds, as the planner counted them (None:
            not counted); :meth:`at_depth` places by it what the GPU no longer holds.
    """

    workload: Workload
    options: Choice
    budgets: Budgets
    name: str
    memory: MemoryEstimate
    time: StepTime
    fits: bool
    reasons: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    optimizer: OptimizerSetup = field(default_factory=OptimizerSetup)
    rotation_note: str = ""
    ram_blocks: int | None = None

    def __post_init__(self) -> None:
        par = self.workload.parallel
        # The rotation this plan counted; whether to split is the caller's (context_parallel).
        rotation = (
            ring_rotation(par, chosen_rotation(self._set)) if par.context_parallel and par.world_size > 1 else "auto"
        )
        self.options = with_options(self.options, ParallelOptions, rotation=rotation)
        tiered = "disk" in self.placement and "ram" in self.placement
        budget = self.host_budget_bytes() if tiered else None
        self.options = with_options(self.options, BudgetOptions, host_budget_bytes=budget)

    @property
    def _set(self) -> OptionSet:
        return OptionSet(self.options)

    @property
    def rotation(self) -> str | None:
        """How ring attention moves keys and values in this plan, "allgather" or "alltoall"
        (``apply_context_parallel(model, mesh, rotation=plan.rotation)``); None without a
        sequence split over ranks."""
        par = self.workload.parallel
        return ring_rotation(par, chosen_rotation(self._set)) if par.splits_sequence else None

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
        w = self.workload
        ram = self.placement.count("ram") * size_class(w.block_input_bytes) + _streamed_host_bytes(w, self._set)
        # The tiered tier keeps some of its cap free, demoting ahead of need; the disk tier's
        # staging buffers are reserved outside the cap (the plan's host figure counts them).
        return max(ram + tiered_reserve_bytes(ram), 1 << 20)

    def to_config(self) -> dict:
        """The :class:`~offloadkit.config.OffloadConfig` keys that realise this plan: each of
        its :attr:`options`' fields the plan writes (:func:`changed_fields`).

        Example:
            >>> from offloadkit.config import OffloadConfig
            >>> from offloadkit.planning.planner import plan
            >>> OffloadConfig.from_dict(plan("tiny", 512, budgets=Budgets(8 << 30, 8 << 30, 8 << 30)).to_config())
            ... # doctest: +ELLIPSIS
            OffloadConfig(...)
        """
        out: dict = {}
        for options in self.options:
            out |= type(options).config_keys(**changed_fields(options))
        return out

    def at_depth(self, layers: int) -> "Plan":
        """This plan realised on a model of ``layers`` decoder layers of the same shape (a
        reduced-depth run of a full-depth plan): the same tiling, streaming, prefetch horizon
        and optimizer placement, block inputs placed for that depth with the plan's longest
        replayed run where the depth allows, and memory, time and fit estimated again.

        Example:
            >>> from offloadkit.planning.planner import plan
            >>> p = plan("llama-3-8b", 131072, budgets=Budgets(79 << 30, 100 << 30, 60 << 30))
            >>> len(p.at_depth(2).to_config()["block_input_placement"])
            2
        """
        if layers == self.workload.shape.layers:
            return self
        w = replace(self.workload, shape=self.workload.shape.with_layers(layers))
        gpu, dropped = input_counts(self.workload, self._set)
        keep = self._set.of(CheckpointOptions).keep_attention
        kept = min(self.workload.shape.layers if keep is True else int(keep), layers)
        choice = with_options(
            self.options, CheckpointOptions, keep_attention=(True if kept >= layers else kept) or False
        )
        placement = self.placement
        f = place_inputs(
            w,
            choice,
            # The oldest block inputs stay offloaded where the plan offloads them; the GPU
            # holds no more of the newest than leave one to offload.
            gpu_blocks=min(gpu, max(0, layers - 2)),
            # A run of dropped inputs replays as many blocks as at full depth, where it fits.
            recompute_blocks=region_length(placement) - 1 if dropped else 0,
            # RAM holds as many as at full depth where some spilled to disk, else as many as
            # the planner found room for (the inputs the GPU held at full depth included).
            ram_blocks=placement.count("ram") if "disk" in placement else self.ram_blocks,
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
            ram_blocks=self.ram_blocks,
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
        o = self._set
        long, streaming = o.of(LongContextOptions), o.of(StreamingOptions)
        chunks, shards, groups = (
            long.loss_chunks if long.chunked_loss else 0,
            tiled_mlp_shards(o),
            long.head_groups or 1,
        )
        horizon = o.of(ActivationOptions).loading_horizon if o.of(ActivationOptions).mode is not False else None
        lines += [
            "",
            f"loss: {'chunked, ' + str(chunks) + ' chunks' if chunks else 'unchunked'};  "
            f"MLP: {str(shards) + ' shards' if shards > 1 else 'untiled'}"
            f"{' (norms and attention projections too)' if long.tiled_projections and shards > 1 else ''};  "
            f"{'attention: ' + str(groups) + ' head groups;  ' if groups > 1 else ''}"
            f"{'ring attention: ' + rotation_name(self.rotation) + ' rotation;  ' if self.rotation else ''}"
            f"{'prefetch horizon: ' + str(horizon) + ';  ' if horizon is not None else ''}"
            f"layer streaming: {'on, depth ' + str(streaming.depth) if streaming.enabled else 'off'}"
            + (
                ""
                if w.lora_rank
                else f";  AdamW state ({w.optimizer_precision}, {w.optimizer_state_bytes} bytes a parameter): "
                + ("host memory, " + self.optimizer.describe() if o.of(OptimizerOptions).enabled else "GPU")
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
            f"{b.rates.attention_flops_per_s / 1e12:.0f} TFLOP/s"
            + (f" ({b.rates.attention_kernel} kernel)" if b.rates.attention_kernel != "auto" else "")
            + f", PCIe {b.rates.pcie_bytes_per_s / 1e9:.1f} GB/s, "
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


def _streamed_host_bytes(w: Workload, f: FootprintOptions) -> int:
    """Host RAM of the streamed layers (they share the engine's host budget)."""
    if streams_weights(w, f):
        return w.shape.layers * size_class(w.shape.layer_params * w.dtype_bytes)
    return 0
