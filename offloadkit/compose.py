"""Apply an :class:`OffloadConfig` to a model: chunked loss, tiled MLP, checkpointing,
activation offloading and layer streaming, in the right order, with one handle to detach
everything.

This is what the Trainer mixins, the callback and the CLI share; plain loops can use it too::

    runtime = prepare(model, OffloadConfig(gradient_checkpointing=True, activation_offloading=True))
    for batch in loader:
        with runtime.context():
            loss = model(**batch).loss
        loss.backward(); opt.step(); opt.zero_grad()
    runtime.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import torch
from torch import nn

from offloadkit.api import attach_to_forward
from offloadkit.checkpointing.component import hf_checkpointing_on
from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.components import COMPONENTS
from offloadkit.config import OffloadConfig
from offloadkit.engine.footprint import default_horizon
from offloadkit.models.blocks import find_blocks
from offloadkit.models.heads import find_output_head, unwrap_model
from offloadkit.parallel.compat import check_parallel, fsdp2_sharded
from offloadkit.runtime.device import use_expandable_segments
from offloadkit.transfer.options import TransferOptions
from offloadkit.transfer.prefetch import PrefetchScheduler
from offloadkit.transfer.timeline import StepTimeline

if TYPE_CHECKING:
    from offloadkit.checkpointing.apply import CheckpointedBlocks
    from offloadkit.engine import OffloadActivations
    from offloadkit.layers.streaming import LayerStreamer
    from offloadkit.longctx.attention_groups import AttentionHeadGroups
    from offloadkit.longctx.causal_lm import ChunkedLossHandle
    from offloadkit.longctx.tiled_mlp import TiledMLPHandle
    from offloadkit.planning import OptimizerSetup, Plan
    from offloadkit.planning.parallelism import Parallelism

__all__ = ["OffloadRuntime", "plan_for", "prepare", "run_parallelism"]


H = TypeVar("H")


class _Handle(Generic[H]):
    """A public attribute of :class:`OffloadRuntime` that is the handle of component ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, run: None, owner: type) -> _Handle[H]: ...

    @overload
    def __get__(self, run: OffloadRuntime, owner: type) -> H | None: ...

    def __get__(self, run, owner):
        return self if run is None else run.handles.get(self.name)

    def __set__(self, run: OffloadRuntime, handle: H | None) -> None:
        run.handles[self.name] = handle


class OffloadRuntime:
    """Everything a config attached to one model. Use :func:`prepare` to build it.

    Attributes:
        handles: each component's handle by its name (:data:`offloadkit.components.COMPONENTS`),
            None where it is off or could not take effect.
        manager: the activation offloading manager (or None).
        checkpointing: offloadkit's checkpointing handle (None when off, or when Hugging
            Face's own gradient checkpointing is on).
        streamer: the layer streamer (or None).
        chunked_loss / tiled_mlp / head_groups: the long-context handles (or None).
    """

    manager: _Handle[OffloadActivations] = _Handle("activations")
    checkpointing: _Handle[CheckpointedBlocks] = _Handle("checkpointing")
    streamer: _Handle[LayerStreamer] = _Handle("layer_streaming")
    chunked_loss: _Handle[ChunkedLossHandle] = _Handle("chunked_loss")
    tiled_mlp: _Handle[TiledMLPHandle] = _Handle("tiled_mlp")
    head_groups: _Handle[AttentionHeadGroups] = _Handle("head_groups")

    def __init__(
        self,
        model: nn.Module,
        config: OffloadConfig,
        *,
        plan: Plan | None = None,
        gpu_cap: tuple[int, float] | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.handles: dict[str, Any] = {component.name: None for component in COMPONENTS}
        self._forward_attachment: Any = None
        self._gpu_cap = gpu_cap  # (device, fraction) while a GPU budget is enforced
        self._expandable = False  # this runtime switched the allocator to expandable segments
        self.plan = plan  # the planner's Plan under offload_plan: auto
        # The one look-ahead over the link: activations, streamed weights and an optimizer
        # built with scheduler=runtime.scheduler fetch ahead within its window.
        self.scheduler = PrefetchScheduler(config.options(TransferOptions).window_bytes)
        # The one set of step hooks those clients act on; made by the first that needs it
        # (step_timeline()), once checkpointing has wrapped the blocks.
        self.timeline: StepTimeline | None = None
        self.notes: list[str] = list(config._warnings)

    def context(self):
        """Wrap each training forward (and loss) in this; a no-op when offloading is off."""
        return self.manager if self.manager is not None else contextlib.nullcontext()

    def attach_to_forward(self) -> None:
        """Offload around every training forward without wrapping the step (callback route)."""
        if self.manager is not None and self._forward_attachment is None:
            self._forward_attachment = attach_to_forward(self.manager, self.model)

    def step_timeline(self) -> StepTimeline:
        """The run's one :class:`~offloadkit.transfer.StepTimeline`, made on first use.

        Made after checkpointing (an earlier component): a failed forward closes its stale
        region (whose saved-tensor hooks are on top of the stack) before the manager's forward
        end pops its own."""
        if self.timeline is None:
            self.timeline = StepTimeline(self.model, head=find_output_head(unwrap_model(self.model)))
        return self.timeline

    def report(self) -> dict:
        out: dict = {"config": self.config.to_dict(), "notes": self.notes}
        if self.plan is not None:
            out["plan"] = {
                "name": self.plan.name,
                "placement": self.plan.placement,
                "fits": self.plan.fits,
                "predicted_gpu_peak_bytes": self.plan.memory.gpu_peak,
                "predicted_host_bytes": self.plan.memory.host,
                "predicted_disk_bytes": self.plan.memory.disk,
                "predicted_step_s": self.plan.time.seconds,
                "bound": self.plan.time.bound,
                # What the plan assumed of a full fine-tune's optimizer (when it updates).
                "updates_in_backward": self.plan.workload.updates_in_backward,
                "optimizer": self.plan.optimizer.describe(),
            }
            par = self.plan.workload.parallel
            if par.world_size > 1:
                out["plan"]["parallel"] = {
                    "world_size": par.world_size,
                    "context_parallel": par.context_parallel,
                    "ranks_per_host": par.ranks_per_host,
                }
        out["prefetch"] = {
            "window_bytes": self.scheduler.window_bytes,
            "peak_pending_bytes": self.scheduler.peak_pending_bytes,
            "lanes": self.scheduler.stats(),
        }
        for component in COMPONENTS:
            handle = self.handles.get(component.name)
            if handle is not None and component.report is not None:
                out.update(component.report(handle))
        return out

    def close(self) -> None:
        """Detach everything: the model is an ordinary model again (all weights on the GPU)."""
        if self._forward_attachment is not None:
            self._forward_attachment.remove()
            self._forward_attachment = None
        for component in reversed(COMPONENTS):
            handle = self.handles.get(component.name)
            if handle is not None:
                component.remove(handle)
                self.handles[component.name] = None
        if self.timeline is not None:  # after every client that subscribed to it
            self.timeline.remove()
            self.timeline = None
        if self._gpu_cap is not None:
            device, _ = self._gpu_cap
            torch.cuda.set_per_process_memory_fraction(1.0, device)
            self._gpu_cap = None
        if self._expandable:
            use_expandable_segments(False)  # segments mapped from now on are the default kind again
            self._expandable = False

    def note(self, message: str) -> None:
        """Record ``message`` (a setting that cannot take effect) from a component's build and
        warn it, pointing at :func:`prepare`'s caller."""
        self._note(message, stacklevel=5)  # _note, note, the build, prepare(), its caller

    def _note(self, message: str, stacklevel: int = 3) -> None:
        self.notes.append(message)
        warnings.warn(f"offloadkit: {message}", UserWarning, stacklevel=stacklevel)


def _cap_gpu_memory(budget: int | None) -> tuple[int, float] | None:
    """Cap the caching allocator of the current CUDA device at ``budget`` bytes.

    Returns:
        ``(device, fraction)`` while capped (``close()`` lifts it), None without CUDA or budget.
    """
    if budget is None or not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, budget / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return device, fraction


def _lora_rank(model: nn.Module) -> int:
    """The LoRA rank of a PEFT model (its first adapter's A matrix), 0 without adapters."""
    for name, p in model.named_parameters():
        if "lora_A" in name and p.dim() == 2:
            return int(p.shape[0])
    return 0


def _built_layers(model: nn.Module) -> int | None:
    """Decoder layers the model really has (its repeated blocks), which is what is
    checkpointed and placed; None where none are found. A model's config may say otherwise
    (layers cut off after loading, or a config shared with a deeper model)."""
    try:
        return len(find_blocks(model))
    except ValueError:
        return None


def _check_placement_depth(model: nn.Module, config: OffloadConfig) -> None:
    """Refuse a ``block_input_placement`` made for another depth than the model's.

    Raises:
        ConfigError: its length differs from the number of decoder layers built.
    """
    from offloadkit.config import ConfigError

    ckpt = config.options(CheckpointOptions)
    places = ckpt.block_input_placement
    # A plan (offload_plan: auto) may turn checkpointing on, keeping a placement it sets none for.
    checkpointed = ckpt.enabled or config.offload_plan == "auto"
    if not (places and checkpointed) or hf_checkpointing_on(model):
        return  # nothing placed, or ignored with a note
    layers = _built_layers(model)
    if layers is not None and len(places) != layers:
        raise ConfigError(
            f"block_input_placement has {len(places)} places, but the model has {layers} decoder layers; give one "
            f"place per layer built: plan the model as built (offload_plan: auto), or realise a deeper plan at "
            f"this depth with Plan.at_depth({layers}).to_config()"
        )


def _plans_fused_lora(model: nn.Module, config: OffloadConfig) -> bool:
    """Whether the plan counts the fused LoRA path: asked for, or left unset with every LoRA
    linear layer fusable (the plan then turns it on: faster, and less saved per layer). A
    list fuses some layers: counted as none (the larger)."""
    if config.fused_lora is None:
        from offloadkit.lora.fused import unfusable_reason

        # Selective checkpointing that saves matmul outputs refuses the fused path's in-place sum.
        return unfusable_reason(model) is None and "mm" not in (config.selective_checkpointing or ())
    return config.fused_lora is True


def _auto_kernels(model: nn.Module, config: OffloadConfig) -> OffloadConfig:
    """Under ``offload_plan: auto``, Liger's norm and gated-MLP kernels where each runs on this
    model, unless a key sets it (faster, and less saved per layer; within the kernels'
    tolerance, as the fused LoRA path)."""
    from offloadkit.kernels.component import auto_kernels
    from offloadkit.kernels.options import KernelOptions

    own = config.options(KernelOptions)
    chosen = auto_kernels(model, own)
    if chosen == own:
        return config
    return config.replace(**KernelOptions.config_keys(rms_norm=chosen.rms_norm, glu_activation=chosen.glu_activation))


def component_options(config: OffloadConfig, model: nn.Module | None = None) -> tuple:
    """Every component's options as ``config`` sets them, for the planner to count their
    footprints (it chooses some of them itself; the others pass through its plan); with
    ``model``, as they will take effect on it (what a build would refuse, off)."""
    options = {c.options: config.options(c.options) for c in COMPONENTS}
    if model is not None:
        for c in COMPONENTS:
            if c.effective is not None:
                options[c.options] = c.effective(model, options[c.options])
    return tuple(options.values())


def run_parallelism() -> Parallelism:
    """This process's ranks as the launcher and ``torch.distributed`` tell them: the world
    size of an initialised process group (else the launcher's ``WORLD_SIZE``) and the ranks on
    this host (``LOCAL_WORLD_SIZE``), each rank with its own sequences. Whether a sequence is
    split over the ranks is the caller's to say (``prepare(..., parallel=...)``, or
    ``context_parallel: true`` in the config): nothing else tells before
    :func:`~offloadkit.parallel.apply_context_parallel` runs."""
    import torch.distributed as dist

    from offloadkit.planning.parallelism import Parallelism
    from offloadkit.runtime.ranks import local_world_size, world_size

    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else world_size()
    return Parallelism(world_size=max(1, ranks), ranks_per_host=local_world_size())


def plan_for(
    model: nn.Module,
    config: OffloadConfig,
    seq_len: int | None = None,
    optimizer: OptimizerSetup | None = None,
    parallel: Parallelism | None = None,
):
    """The planner's :class:`~offloadkit.planning.Plan` for ``model`` as built (its config's
    layer shape, at the depth of the decoder layers it has) at ``seq_len`` (else
    ``config.seq_len``), under this machine's budgets (``host_budget_bytes`` caps the RAM),
    for the optimizer ``optimizer`` describes (None: see :func:`prepare`).

    Over several processes the plan is one rank's (``parallel``, default
    :func:`run_parallelism`): its share of the host's RAM and disk, and, where ``parallel``
    says each sequence is split over the ranks, its share of ``seq_len``, which is then the
    whole sequence. ``host_budget_bytes`` is one rank's cap, as the runtime applies it.

    Raises:
        ConfigError: without a sequence length, or for a model without a decoder config.
    """
    from offloadkit.config import ConfigError
    from offloadkit.planning import Budgets, plan, resolve_shape

    seq_len = seq_len if seq_len is not None else config.seq_len
    if seq_len is None:
        raise ConfigError(
            "offload_plan: auto needs the sequence length: set seq_len (e.g. seq_len: 131072) "
            "or pass prepare(model, config, seq_len=...)"
        )
    base = unwrap_model(model)
    try:
        shape = resolve_shape(base)
    except ValueError as exc:
        raise ConfigError(f"offload_plan: auto cannot read the model's shape: {exc}") from exc
    layers = _built_layers(model)
    if layers is not None and layers != shape.layers:
        # Every layer built is checkpointed and placed: the plan must have one place for each.
        shape = shape.with_layers(layers)
    embed = getattr(base, "get_input_embeddings", lambda: None)()
    dtype_bytes = embed.weight.element_size() if embed is not None else next(base.parameters()).element_size()
    if parallel is None:
        parallel = run_parallelism()
        if config.context_parallel and parallel.world_size > 1:
            # context_parallel: true splits each sequence over every rank (the Trainer's turns).
            parallel = dataclasses.replace(parallel, context_parallel=True, rotation=config.context_parallel_rotation)
        if parallel.world_size > 1 and fsdp2_sharded(model) is not None:
            # fully_shard-ed: each rank holds its shards of the weights, gradients and state.
            parallel = dataclasses.replace(parallel, shard_weights=True)
        if getattr(model, "gradient_as_bucket_view", False) is True:
            # Already wrapped by DDP with its gradients as views of its buckets: no second copy.
            parallel = dataclasses.replace(parallel, bucket_view=True)
    budgets = Budgets.detect(
        gpu_bytes=config.gpu_budget_bytes,
        host_bytes_per_rank=config.host_budget_bytes,
        disk_dir=config.disk_dir,
        ranks_per_host=parallel.ranks_per_host,
    )
    return plan(
        shape,
        seq_len,
        batch=config.batch_size,
        lora_rank=_lora_rank(model),
        budgets=budgets,
        dtype_bytes=dtype_bytes,
        stream_depth=config.layer_offloading_depth,
        optimizer_precision=config.optimizer_precision,
        optimizer=optimizer,
        parallel=parallel,
        fused_lora=_plans_fused_lora(model, config),
        options=component_options(config, model),
    )


def _planned(
    model: nn.Module,
    config: OffloadConfig,
    seq_len: int | None,
    optimizer: OptimizerSetup | None,
    parallel: Parallelism | None = None,
) -> tuple[OffloadConfig, Plan | None]:
    """The config :func:`prepare` applies and, under ``offload_plan: auto``, the plan it comes from."""
    if config.offload_plan != "auto":
        return config, None
    if optimizer is None:
        from offloadkit.planning import OptimizerSetup

        # Without a Trainer nothing replaces the loop's optimizer: only one asked for moves.
        asked = config.optimizer_offloading
        optimizer = OptimizerSetup(
            replaceable=asked,
            source="assumed: max_grad_norm=1.0; optimizer_offloading: "
            + ("true, BackwardAdamW" if asked else "false, the loop's own optimizer"),
        )
    config = _auto_kernels(model, config)
    chosen = plan_for(model, config, seq_len, optimizer, parallel)
    applied = config.replace(**chosen.to_config())  # a placement it sets is for the depth built
    # The plan counts what a component would refuse on this model as off (Component.effective);
    # the run keeps the config's value, so that the component's build says why it has no effect.
    for c in COMPONENTS:
        if c.effective is not None:
            own = config.options(c.options)
            applied = applied.replace(**{key: getattr(own, name) for key, name in c.options.keys().items()})
    return applied, chosen


def _horizon_beside_state(config: OffloadConfig, optimizer: OptimizerSetup | None) -> OffloadConfig:
    """Where BackwardAdamW's state travels on the link in backward, block inputs come back as
    far ahead as from disk (:func:`~offloadkit.engine.footprint.default_horizon`, which the
    planner counts too), unless the config sets ``activation_loading_horizon``."""
    moves_state = config.optimizer_offloading and optimizer is not None and optimizer.replaceable
    if config.activation_loading_horizon is not None or not (moves_state and optimizer.updates_in_backward):
        return config
    if config.activation_offloading is not True:
        return config  # the disk tiers already fetch that far ahead; legacy copies on compute
    return config.replace(activation_loading_horizon=default_horizon(False, state_in_backward=True))


def prepare(
    model: nn.Module,
    config: OffloadConfig | dict | None = None,
    *,
    seq_len: int | None = None,
    optimizer: OptimizerSetup | None = None,
    parallel: Parallelism | None = None,
) -> OffloadRuntime:
    """Attach what ``config`` asks for to ``model``; returns the :class:`OffloadRuntime`.

    Settings that cannot take effect on this machine or model are skipped with one warning
    each (no GPU for layer streaming, no frozen weights to stream, streams on a CPU-only
    machine). With ``activation_offloading: disk`` on a CPU-only machine, CPU activations
    go to disk (that saves host RAM).

    With ``offload_plan: auto`` the planner decides checkpointing, activation offloading,
    layer streaming, loss chunks and MLP shards for ``seq_len`` (else ``config.seq_len``);
    its choice replaces those keys (``runtime.plan`` holds the plan, ``runtime.config`` the
    config applied). On a CUDA machine the caching allocator maps expandable segments while the
    runtime is open, unless ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) is set.

    ``optimizer`` tells the planner whether a full fine-tune's optimizer may be replaced by
    BackwardAdamW (its state in host memory) and when it updates; the Trainer mixins pass
    what their arguments and optimizer say. None, for a loop that builds its own optimizer:
    the state is planned in host memory only with ``optimizer_offloading: true`` (the loop
    then steps BackwardAdamW), under the Trainer's default clipping (``max_grad_norm=1.0``,
    every gradient held until ``step()``). A loop that steps BackwardAdamW without clipping
    passes ``OptimizerSetup(updates_in_backward=True)``.

    Under a launcher the plan is one rank's (``parallel``, default :func:`run_parallelism`: the
    process group's ranks, each with its own sequences, sharing the host's RAM and disk with
    ``LOCAL_WORLD_SIZE`` ranks). A loop that splits each sequence over the ranks
    (:func:`~offloadkit.parallel.apply_context_parallel`) passes
    ``Parallelism(world_size, context_parallel=True, ranks_per_host=...)`` with ``seq_len`` the
    whole sequence; without it, ``seq_len`` is the tokens each rank holds.

    Raises:
        ConfigError: the disk tier's directory is a file or cannot be written; or what the
            config asks cannot run where FSDP2 shards the model (layer streaming, recomputed
            block inputs: :mod:`offloadkit.parallel.compat`).

    Example:
        >>> runtime = prepare(model, {"offload_plan": "auto", "seq_len": 131072})  # doctest: +SKIP
    """
    if not isinstance(config, OffloadConfig):
        config = OffloadConfig.from_dict(config or {})
    config.check_paths()  # a bad disk directory fails here, not inside the first step
    _check_placement_depth(model, config)  # before anything is capped or attached
    gpu_cap = _cap_gpu_memory(config.gpu_budget_bytes)  # before anything allocates under the plan
    config, chosen = _planned(model, config, seq_len, optimizer, parallel)
    config = _horizon_beside_state(config, optimizer)
    runtime = OffloadRuntime(model, config, plan=chosen, gpu_cap=gpu_cap)
    try:  # what cannot run under the model's wrapper, before anything is attached
        check_parallel(model, config, planned=chosen is not None, hf_checkpointing=hf_checkpointing_on(model))
    except ValueError:
        runtime.close()  # lifts the cap
        raise
    # Segments that grow in place, for every run offloadkit prepares: fixed-size ones strand
    # room that no large block fits (1.39x the allocated bytes reserved by a 3B full fine-tune,
    # 1.66x at 512K tokens, no room for SDPA's one large request under a cap), and a plan's
    # reservation figure assumes them. Put back by close(); a user's PYTORCH_CUDA_ALLOC_CONF wins.
    runtime._expandable = use_expandable_segments()
    if config.gpu_budget_bytes is not None and gpu_cap is None:
        runtime._note("gpu_budget_bytes has no effect without a CUDA GPU")
    if chosen is not None and not chosen.fits:
        runtime._note(
            f"offload_plan: auto found no plan within the budgets ({'; '.join(chosen.reasons)}); "
            f"applying the most frugal one ({chosen.name})"
        )
    # Each component in apply order, from its options and the handles built before it. A build
    # that fails detaches what the ones before it attached (and puts the allocator back).
    try:
        for component in COMPONENTS:
            runtime.handles[component.name] = component.build(model, config.options(component.options), runtime)
    except BaseException:
        runtime.close()
        raise
    return runtime
