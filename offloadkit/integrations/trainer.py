"""Hugging Face ``Trainer`` integration: mixins for your Trainer class, or a callback.

Mixins (compose with TRL's ``SFTTrainer`` or any Trainer subclass)::

    class MyTrainer(ActivationOffloadingMixin, SFTTrainer):
        pass

    trainer = MyTrainer(model=model, args=args, train_dataset=ds, offload_config="offload.yaml")

Callback, for code that cannot change its Trainer class::

    trainer.add_callback(OffloadCallback({"activation_offloading": True}, trainer=trainer))

Everything is attached when ``train()`` starts and detached when it ends, so the model is
an ordinary model for evaluation, generation and saving afterwards. Evaluation and
generation run without offloading (no gradients, nothing saved). Gradient checkpointing
is Hugging Face's own, switched to non-reentrant and set under the field name of every
transformers version; it is checked to be on at the first training step (offloadkit's
own takes over if not). Selective checkpointing uses offloadkit's.

TRL's ``activation_offloading=True`` (``SFTConfig`` and the other TRL configs) builds TRL's own
offloading engine in the trainer's constructor; stacked with offloadkit's, every activation
would be copied twice. The mixin keeps TRL from building it and offloads itself. A callback
comes after the constructor and is not handed the trainer by transformers: given it
(``trainer=``), it switches TRL's engine off when training begins and offloads in its place;
without it, it refuses to start, naming the fixes.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from typing import Any

import torch

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.compose import OffloadRuntime, prepare
from offloadkit.config import ALIASES, ConfigError, OffloadConfig, load_mapping
from offloadkit.extras import require
from offloadkit.integrations.hf_args import (
    checkpointing_kwargs,
    checkpointing_requested,
    model_checkpointing_on,
    set_checkpointing,
    user_set,
)
from offloadkit.models.heads import unwrap_model

__all__ = ["ActivationOffloadingMixin", "LayerOffloadingMixin", "OffloadCallback", "resolve_config"]

_TRL_NOTE = (
    "TRL's activation_offloading is switched off: offloadkit's {route} offloads the activations "
    "(one engine, not two stacked)"
)


def resolve_config(offload_config: Any, args=None, defaults: dict | None = None) -> OffloadConfig:
    """An :class:`OffloadConfig` from a config object, dict, YAML/JSON path or ``None``,
    completed by same-named attributes the user set on the training arguments
    (``activation_offloading``, ``activation_loading_horizon``, SageMaker's
    ``sm_activation_offloading``, ...), by their checkpointing flag, and by ``defaults``."""
    if isinstance(offload_config, OffloadConfig):
        data = offload_config.to_dict()
    elif isinstance(offload_config, str):
        data = load_mapping(offload_config)
    elif offload_config is None:
        data = {}
    else:
        data = dict(offload_config)
    data = {ALIASES.get(k, k): v for k, v in data.items()}
    if args is not None:
        for key in (*OffloadConfig.keys(), *ALIASES):
            target = ALIASES.get(key, key)
            if target not in data and key != "gradient_checkpointing" and user_set(args, key):
                data[target] = getattr(args, key)
        if checkpointing_requested(args):
            data.setdefault("gradient_checkpointing", True)
    for key, value in (defaults or {}).items():
        data.setdefault(key, value)
    return OffloadConfig.from_dict(data, source="offload config")


def _use_hf_checkpointing(args, config: OffloadConfig):
    """Hand plain checkpointing to the Trainer (non-reentrant); selective checkpointing,
    placed or dropped block inputs and planned runs stay offloadkit's.

    Returns:
        ``(config for prepare(), restore)``: ``restore()`` puts the arguments back.
    """
    if not config.gradient_checkpointing:
        return config, lambda: None
    if (
        config.selective_checkpointing
        or config.recompute_block_inputs
        or config.block_input_placement
        or config.offload_plan == "auto"
    ):
        # Only offloadkit's checkpointing saves selectively, places or drops block inputs (a
        # plan, made in prepare(), may place them: the Trainer's own would checkpoint again).
        return config, set_checkpointing(args, False)
    kwargs = checkpointing_kwargs(args)
    # Either kind works: reentrant checkpointing saves its inputs through the same hooks
    # (measured bitwise, the same bytes offloaded); non-reentrant is the default asked for.
    kwargs.setdefault("use_reentrant", False)
    return config.replace(gradient_checkpointing=False), set_checkpointing(args, True, kwargs)


def _train_args(args: tuple, kwargs: dict):
    """The training arguments passed to a Trainer constructor (keyword or second positional)."""
    if "args" in kwargs:
        return kwargs["args"]
    return args[1] if len(args) > 1 else None


def _switch_off_trl_engine(trainer: Any) -> bool:
    """Replace TRL's activation offloading context (built in its trainer's constructor) by a
    no-op; returns whether there was one."""
    own = getattr(trainer, "maybe_activation_offload_context", None)
    if own is None or isinstance(own, contextlib.nullcontext):
        return False
    trainer.maybe_activation_offload_context = contextlib.nullcontext()
    return True


def deepspeed_zero_stage(args) -> int | None:
    """The ZeRO stage of ``TrainingArguments.deepspeed`` (a dict or a JSON file), or None."""
    config = getattr(args, "deepspeed", None)
    if isinstance(config, str):
        try:
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
    if not isinstance(config, dict):
        return None
    stage = (config.get("zero_optimization") or {}).get("stage")
    return stage if isinstance(stage, int) else None


def check_deepspeed(offload_config, args) -> str | None:
    """Refuse what cannot work under DeepSpeed; returns a note, or None.

    Raises:
        ConfigError: layer streaming with DeepSpeed.
    """
    if not getattr(args, "deepspeed", None):
        return None
    if offload_config.layer_offloading:
        # DeepSpeed places (and with ZeRO-3 partitions) the weights itself: two owners of
        # the same storage cannot coexist.
        raise ConfigError(
            "layer_offloading cannot stream weights that DeepSpeed manages (TrainingArguments."
            "deepspeed is set); use DeepSpeed's own offload_param in its config, or turn "
            "layer_offloading off"
        )
    return None


class _OffloadingTrainerMixin:
    """Shared implementation; the public mixins differ only in their defaults."""

    _offload_defaults: dict = {}
    # Provided by the Trainer this is mixed into.
    args: Any
    model: Any

    def __init__(self, *args, offload_config: Any = None, **kwargs):
        train_args = _train_args(args, kwargs)
        notes: list[str] = []
        trl_flag = getattr(train_args, "activation_offloading", None) is True
        if trl_flag:
            # TRL builds its own offloading context in __init__ when this is on; the mixin's
            # engine replaces it, so TRL must not build one (two stacked engines copy twice).
            train_args.activation_offloading = False
            notes.append(_TRL_NOTE.format(route="mixin"))
        super().__init__(*args, **kwargs)
        if _switch_off_trl_engine(self) and not notes:
            notes.append(_TRL_NOTE.format(route="mixin"))
        defaults: dict = {}
        for cls in reversed(type(self).__mro__):  # both mixins' defaults when both are used
            defaults.update(cls.__dict__.get("_offload_defaults", {}))
        if trl_flag:
            defaults["activation_offloading"] = True
        self.offload_config = resolve_config(offload_config, self.args, defaults)
        deepspeed_note = check_deepspeed(self.offload_config, self.args)
        if deepspeed_note:
            notes.append(deepspeed_note)
        self.offload_runtime: OffloadRuntime | None = None
        self.offload_report: dict | None = None
        self.offload_notes = notes
        for note in notes:
            warnings.warn(f"offloadkit: {note}", UserWarning, stacklevel=2)
        self._checkpointing_active: bool | None = None
        # The optimizer create_optimizer made for optimizer_offloading (None: the Trainer's own).
        self._backward_optimizer: Any = None

    def train(self, *args, **kwargs):
        was_on = model_checkpointing_on(unwrap_model(self.model))
        config, restore_args = _use_hf_checkpointing(self.args, self.offload_config)
        self.offload_runtime = prepare(self.model, config, optimizer=_planned_optimizer(self))
        self._checkpointing_active = None
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._backward_optimizer is not None:
                # Its hooks belong to this run: a later backward (evaluation, the user's own
                # loop) must leave the gradients alone; the next train() attaches them again.
                self._backward_optimizer.remove()
            report = self.offload_runtime.report()
            report["config"] = self.offload_config.to_dict()  # as asked, checkpointing included
            report["checkpointing_active"] = bool(self._checkpointing_active)
            report["notes"] = self.offload_notes + report["notes"]
            self.offload_report = report
            self.offload_runtime.close()
            self.offload_runtime = None
            restore_args()
            base = unwrap_model(self.model)
            if not was_on and not checkpointing_requested(self.args) and model_checkpointing_on(base):
                # The mixin turned the Trainer's checkpointing on; leave the model as it came.
                disable = getattr(base, "activation_checkpointing_disable", None) or base.gradient_checkpointing_disable
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    disable()

    def _check_checkpointing(self) -> None:
        """On the first training forward: is the checkpointing that was asked for really on?

        If the Trainer did not switch it on (a transformers version reading another field),
        offloadkit's own checkpointing takes over, with one note; never silently dropped.
        """
        runtime = self.offload_runtime
        wanted = self.offload_config.gradient_checkpointing
        active = model_checkpointing_on(unwrap_model(self.model)) or runtime.checkpointing is not None
        if wanted and not active:
            runtime.checkpointing = apply_activation_checkpointing(
                self.model, selective=self.offload_config.selective_checkpointing
            )
            runtime._note(
                "gradient_checkpointing: the Trainer did not switch it on; offloadkit's own "
                "checkpointing is used instead"
            )
            active = True
        self._checkpointing_active = active

    def create_optimizer(self, *args, **kwargs):
        from offloadkit.integrations.optimizer import attach_for_run, backward_adamw_for

        # The config in effect: offload_plan: auto may have chosen optimizer offloading.
        in_run = self.offload_runtime is not None
        config = self.offload_runtime.config if in_run else self.offload_config
        current = getattr(self, "optimizer", None)
        if config.optimizer_offloading and current is None:
            current, note = backward_adamw_for(self, config)
            self.optimizer = self._backward_optimizer = current
            self.offload_notes.append(note)
            warnings.warn(f"offloadkit: {note}", UserWarning, stacklevel=2)
        ours = self._backward_optimizer
        if ours is None or not (current is ours or getattr(current, "optimizer", None) is ours):
            return super().create_optimizer(*args, **kwargs)
        # Kept across train() calls, as the Trainer keeps its own (prepared by Accelerate after
        # the first run): attached for this run's settings, or detached until a run begins.
        if in_run and config.optimizer_offloading:
            attach_for_run(self, ours)
        else:
            ours.remove()
        return current

    def training_step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        runtime = self.offload_runtime
        cp = runtime.handles.get("context_parallel") if runtime is not None else None
        if cp is None:
            return super().training_step(model, inputs, num_items_in_batch, *args, **kwargs)
        from offloadkit.integrations.context_parallel import training_step_in_turns

        if self._checkpointing_active is None:
            self._check_checkpointing()
        return training_step_in_turns(self, cp, model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, *args, **kwargs):
        runtime = self.offload_runtime
        training = runtime is not None and model.training and torch.is_grad_enabled()
        if training and self._checkpointing_active is None:
            self._check_checkpointing()
        if training:
            from offloadkit.integrations.optimizer import reduce_for_run

            # The model here is the run's wrapper (DDP once Accelerate prepared it).
            reduce_for_run(getattr(self, "optimizer", None), model)
        if not training or runtime.manager is None:
            return super().compute_loss(model, inputs, *args, **kwargs)
        with runtime.context():
            return super().compute_loss(model, inputs, *args, **kwargs)


class ActivationOffloadingMixin(_OffloadingTrainerMixin):
    """Trainer mixin: activation offloading (with checkpointing when the config or the
    training arguments ask for it), chosen for PEFT/LoRA models as
    ``get_lora_act_offloading_ctx_manager`` does. Default: ``activation_offloading: true``.

    Args:
        offload_config: an :class:`OffloadConfig`, a dict, a YAML/JSON path, or None
            (then the training arguments' attributes and the defaults apply).
    """

    _offload_defaults = {"activation_offloading": True}


class LayerOffloadingMixin(_OffloadingTrainerMixin):
    """Trainer mixin: frozen-layer streaming (``layer_offloading: true`` by default)."""

    _offload_defaults = {"layer_offloading": True}


_CallbackBase: Any
try:  # the callback needs transformers; the mixins only need a Trainer to mix into
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # pragma: no cover
    _CallbackBase = object


class OffloadCallback(_CallbackBase):
    """Offloading for a Trainer whose class you cannot change.

    The activation manager is entered around every training forward through model hooks
    (the loss computed inside the model's forward is covered; backward runs outside, as
    usual). Attached at ``on_train_begin``, detached at ``on_train_end``. A ``train()`` that
    raises never reaches ``on_train_end``: :meth:`close` detaches then (the next ``train()``
    does it first).

    Args:
        offload_config: an :class:`OffloadConfig`, a dict or a YAML/JSON path.
        trainer: the Trainer this callback is added to. Needed with TRL's
            ``activation_offloading=True``: its engine is then switched off when training
            begins, and offloadkit offloads instead.

    Raises:
        ConfigError: at ``on_train_begin``, with TRL's ``activation_offloading=True``, offloadkit
            offloading activations too, and no ``trainer`` to switch TRL's engine off in.
    """

    def __init__(self, offload_config: Any = None, *, trainer: Any = None):
        if _CallbackBase is object:  # transformers is not installed: say which extra installs it
            require("transformers", "hf", "OffloadCallback")
        self.offload_config = offload_config
        self.trainer = trainer
        self.runtime: OffloadRuntime | None = None
        self.report: dict | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.close()  # what a run that raised left attached
        # Hugging Face checkpointing, when the arguments asked for it, is already on by now;
        # prepare() then leaves checkpointing to it.
        config = resolve_config(self.offload_config, args)
        check_deepspeed(config, args)
        trl_asked = getattr(args, "activation_offloading", None) is True
        # Transformers hands callbacks the model, not the trainer that holds TRL's engine.
        reachable = hasattr(self.trainer, "maybe_activation_offload_context")
        if config.activation_offloading and trl_asked and not reachable:
            raise ConfigError(
                "OffloadCallback: TRL's activation_offloading=True runs TRL's own engine, which would copy every "
                "activation a second time beside offloadkit's, and the callback cannot switch it off without the "
                "trainer that holds it: pass OffloadCallback(config, trainer=trainer), use ActivationOffloadingMixin, "
                "or set activation_offloading=False in TRL's config and activation_offloading in the callback's"
            )
        switched = bool(config.activation_offloading) and _switch_off_trl_engine(self.trainer)
        self.runtime = prepare(model, config)
        if switched:
            self.runtime._note(_TRL_NOTE.format(route="callback"))
        if self.runtime.config.optimizer_offloading:
            # The Trainer builds its optimizer before the first callback runs.
            self.runtime._note(
                "optimizer_offloading has no effect through OffloadCallback: the Trainer made its own optimizer "
                "before training began; use ActivationOffloadingMixin to have it replaced"
            )
        self.runtime.attach_to_forward()
        if self.trainer is not None:
            from offloadkit.integrations.optimizer import reduce_for_run

            # A backward optimizer the user gave the Trainer, under the DDP wrapper it made.
            reduce_for_run(getattr(self.trainer, "optimizer", None), getattr(self.trainer, "model_wrapped", None))

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Detach everything the run attached, keeping its :attr:`report`; nothing when detached."""
        if self.runtime is not None:
            self.report = self.runtime.report()
            self.runtime.close()
            self.runtime = None


def _planned_optimizer(trainer: Any):
    """What ``offload_plan: auto`` may assume of this Trainer's optimizer: its AdamW or SGD
    may be replaced by one with the state in host memory (not one passed in, another
    algorithm, or DeepSpeed's); its updates wait for ``step()`` under clipping, fp16 loss
    scaling or gradient accumulation (every gradient held), as
    :func:`~offloadkit.integrations.optimizer.backward_adamw_for` sets it up."""
    from offloadkit.integrations.optimizer import _ADAMW, _SGD
    from offloadkit.optim import BackwardOptimizer
    from offloadkit.planning import OptimizerSetup

    args = trainer.args
    # Arguments of older transformers (or a Trainer subclass's own) may have no optim field:
    # the Trainer's AdamW then.
    optim = getattr(args, "optim", "adamw_torch")
    optim = str(getattr(optim, "value", optim))
    given = getattr(trainer, "optimizer", None)  # passed in, or kept from an earlier train()
    given = getattr(given, "optimizer", given)  # inside Accelerate's wrapper
    if given is not None and not isinstance(given, BackwardOptimizer):
        fixed = f"the Trainer already has its optimizer, {type(given).__name__}"
    elif getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
        fixed = "optimizer_cls_and_kwargs was given"
    elif getattr(args, "deepspeed", None):
        fixed = "DeepSpeed builds the optimizer"
    elif optim not in _ADAMW + _SGD:
        fixed = f"optim={optim!r} is not AdamW or SGD"
    else:
        fixed = ""
    norm = getattr(args, "max_grad_norm", None) or 0
    deferring = [
        *([f"max_grad_norm={norm}"] if norm > 0 else []),
        *(["fp16 loss scaling"] if getattr(args, "fp16", False) else []),
        *(
            [f"gradient_accumulation_steps={args.gradient_accumulation_steps}"]
            if getattr(args, "gradient_accumulation_steps", 1) > 1
            else []
        ),
        *(
            [f"the given {type(given).__name__} updates at step()"]
            if given is not None and not fixed and not given.updates_in_backward
            else []
        ),
    ]
    source = "Trainer: " + (
        fixed or ", ".join(deferring) or f"optim={optim!r}, max_grad_norm=0, no fp16, no accumulation"
    )
    return OptimizerSetup(replaceable=not fixed, updates_in_backward=not deferring, source=source)
