"""The Trainer's AdamW (or SGD) replaced by :class:`~offloadkit.optim.BackwardAdamW` (or
:class:`~offloadkit.optim.BackwardSGD`) (``optimizer_offloading: true``): the same parameter
groups and hyperparameters as the Trainer's own, the Trainer's learning-rate schedule,
clipping and checkpoints around it.

Its backward hooks belong to one ``train()``: the mixin detaches them when the run ends, and a
later run attaches the same optimizer (its state, as the Trainer keeps its own) with
:func:`attach_for_run`, under that run's clipping and prefetch scheduler."""

from __future__ import annotations

from typing import Any

from offloadkit.config import ConfigError
from offloadkit.models.blocks import find_blocks
from offloadkit.optim import BackwardAdamW, BackwardOptimizer, BackwardSGD

__all__ = ["attach_for_run", "backward_adamw_for", "reduce_for_run"]

# The Trainer's AdamW variants this replaces (the math is torch.optim.AdamW's), and its SGD.
_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")
_SGD = ("sgd",)
_SGD_KEYS = ("lr", "momentum", "dampening", "nesterov")  # weight decay comes with the groups


def backward_adamw_for(trainer: Any, config: Any = None) -> tuple[BackwardOptimizer, str]:
    """A :class:`BackwardAdamW` set up as ``trainer`` would set up its AdamW (a
    :class:`BackwardSGD` for ``optim="sgd"``, with the momentum, dampening and Nesterov of its
    ``optim_args``).

    Args:
        trainer: a ``transformers.Trainer`` (its model, arguments and accelerator are read).
        config: the :class:`~offloadkit.config.OffloadConfig` in effect (default: the
            trainer's ``offload_config``).

    Returns:
        ``(optimizer, note)``: the note says what replaced what, and when updates happen.

    Raises:
        ConfigError: the Trainer's optimizer is neither AdamW nor SGD, or SGD with an
            ``optimizer_precision`` other than "params".
    """
    args, model = trainer.args, trainer.model
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in _ADAMW + _SGD:
        raise ConfigError(
            f"optimizer_offloading replaces the Trainer's AdamW or SGD, but optim={optim!r}; use optim: "
            "adamw_torch (or sgd), or turn optimizer_offloading off"
        )
    decay = set(trainer.get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    clipping, scaled, scheduler = _run_settings(trainer)
    config = config or trainer.offload_config
    precision, state_dir = config.optimizer_precision, config.optimizer_state_dir
    optimizer: BackwardOptimizer
    if optim in _SGD:
        if precision != "params":
            raise ConfigError(
                f"optimizer_precision={precision!r} applies to AdamW's state; SGD's momentum keeps the parameters' "
                "dtype: use optimizer_precision: params with optim: sgd"
            )
        _, kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)
        optimizer = BackwardSGD(
            groups,
            **{k: kwargs[k] for k in _SGD_KEYS if k in kwargs},
            defer_to_step=clipping or scaled,
            update_when=lambda: _syncs(trainer),
            state_dir=state_dir,
            scheduler=scheduler,
        )
        optimizer.set_update_groups(_layer_groups(model))  # as every run's (attach_for_run)
        return optimizer, _note(trainer, optim, "BackwardSGD (the same kernel)", "momentum", clipping, scaled, args)
    optimizer = BackwardAdamW.for_precision(
        groups,
        precision,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        # The Trainer clips (and the fp16 scaler unscales) between backward and step():
        # updates then wait for step().
        defer_to_step=clipping or scaled,
        update_when=lambda: _syncs(trainer),
        # The kernel the Trainer's own AdamW would run, so the updates are bitwise its own.
        fused=optim == "adamw_torch_fused",
        state_dir=state_dir,
        scheduler=scheduler,
    )
    optimizer.set_update_groups(_layer_groups(model))
    state = {
        "fp32_master": "fp32 master weights and moments",
        "compact": "bf16 moments with stochastically rounded updates",
    }.get(precision, "moments in the parameters' dtype")
    kernel = "the same kernel, in fp32 on widened copies" if precision == "compact" else "the same kernel"
    return optimizer, _note(trainer, optim, f"BackwardAdamW ({kernel})", state, clipping, scaled, args)


def attach_for_run(trainer: Any, optimizer: BackwardOptimizer) -> None:
    """Attach ``optimizer`` (made by :func:`backward_adamw_for` for an earlier run, detached
    since) to ``trainer``'s run starting now: its hooks again, that run's clipping or fp16
    deciding whether updates wait for ``step()``, and that run's prefetch scheduler.

    Raises:
        ConfigError: as :func:`backward_adamw_for`, for this run's settings.
    """
    clipping, scaled, scheduler = _run_settings(trainer)
    optimizer.defer_to_step = clipping or scaled
    optimizer.use_scheduler(scheduler)
    optimizer.set_update_groups(_layer_groups(trainer.model))
    optimizer.attach()


def _layer_groups(model: Any) -> list[list[Any]]:
    """Each decoder layer's trainable parameters, updated together in backward (none found:
    no groups, the state's look-ahead is its byte window alone)."""
    try:
        blocks = find_blocks(model)
    except ValueError:
        return []
    return [[p for p in block.parameters() if p.requires_grad] for _, block in blocks]


def reduce_for_run(optimizer: Any, model: Any) -> None:
    """Tell a backward optimizer (or the Accelerate wrapper around one) how the run's model
    wrapper reduces gradients: a ``DistributedDataParallel`` model gets its communication hook,
    so that updates in backward apply the reduced gradients. Under FSDP2, Accelerate has put
    the sharded parameters in the optimizer's groups: the hooks and the update groups follow
    them (:meth:`~offloadkit.optim.backward.BackwardOptimizer.follow_parameters`)."""
    ours = optimizer if isinstance(optimizer, BackwardOptimizer) else getattr(optimizer, "optimizer", None)
    if not isinstance(ours, BackwardOptimizer):
        return
    from torch.nn.parallel import DistributedDataParallel

    if ours.follow_parameters():
        ours.set_update_groups(_layer_groups(model))
    if isinstance(model, DistributedDataParallel):
        ours.reduce_with_ddp(model)


def _syncs(trainer: Any) -> bool:
    # Read from the trainer at each call: a hyperparameter search makes a new accelerator.
    return bool(trainer.accelerator.sync_gradients)


def _run_settings(trainer: Any) -> tuple[bool, bool, Any]:
    """``(clipping, fp16 scaling, scheduler)`` of ``trainer``'s arguments and current run.

    Raises:
        ConfigError: trainable layers in files with updates deferred to ``step()``.
    """
    args = trainer.args
    clipping = bool(args.max_grad_norm) and args.max_grad_norm > 0
    # fp16's loss scaler unscales the gradients and skips steps with inf/nan at step(): an
    # update in backward would apply scaled gradients and bypass that check.
    scaled = bool(getattr(args, "fp16", False))
    # The state's look-ahead shares the run's one prefetch scheduler (and its window) with the
    # activations and streamed weights.
    runtime = getattr(trainer, "offload_runtime", None)
    streamer = getattr(runtime, "streamer", None)
    in_files = streamer.stats.disk_layers if streamer is not None and streamer.trainable else 0
    if in_files and (clipping or scaled):
        # Refused here, before the first step, rather than at the first deferred update.
        why = f"max_grad_norm={args.max_grad_norm}" if clipping else "fp16 loss scaling"
        raise ConfigError(
            f"layer_offloading_dir put {in_files} trainable layers in files, whose weights are updated in backward "
            f"only; {why} defers the updates to step(). Use max_grad_norm: 0 (and bf16 rather than fp16), or raise "
            "host_budget_bytes so the trainable layers stay in pinned RAM"
        )
    return clipping, scaled, getattr(runtime, "scheduler", None)


def _note(trainer: Any, optim: str, by: str, state: str, clipping: bool, scaled: bool, args: Any) -> str:
    """What replaced what, where its state lives, and when it updates."""
    if scaled:
        when = "updates at step(), after the fp16 loss scaler unscales the gradients and checks them for inf/nan"
    elif clipping:
        when = (
            f"updates at step(), after the Trainer's clipping (max_grad_norm={args.max_grad_norm}; 0 updates in "
            "backward and frees each gradient at once)"
        )
    else:
        when = "each parameter updated in backward"
    state_dir = getattr(getattr(trainer, "offload_config", None), "optimizer_state_dir", None)
    where = f"memory-mapped files in {state_dir} (paged to disk past RAM)" if state_dir else "host memory"
    note = f"optimizer_offloading: the Trainer's {optim} is replaced by {by}, {state} in {where}, {when}"
    runtime = getattr(trainer, "offload_runtime", None)
    streamer = getattr(runtime, "streamer", None)
    if getattr(streamer, "trainable", False) and (clipping or scaled):
        note += (
            "; the layers' weights are streamed, so each deferred update reads and writes them in host memory "
            "over the bus, with every gradient held on the GPU until step() (max_grad_norm: 0 updates each "
            "layer in backward while it is resident)"
        )
    return note
