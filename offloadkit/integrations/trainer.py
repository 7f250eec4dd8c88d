"""Hugging Face ``Trainer`` integration: mixins for your Trainer class, or a callback.

Mixins (compose with TRL's ``SFTTrainer`` or any Trainer subclass)::

    class MyTrainer(ActivationOffloadingMixin, SFTTrainer):
        pass

    trainer = MyTrainer(model=model, args=args, train_dataset=ds, offload_config="offload.yaml")

Callback, for code that cannot change its Trainer class::

    trainer.add_callback(OffloadCallback({"activation_offloading": True}))

Everything is attached when ``train()`` starts and detached when it ends, so the model is
an ordinary model for evaluation, generation and saving afterwards. Evaluation and
generation run without offloading (no gradients, nothing saved). Gradient checkpointing
is Hugging Face's own, switched to non-reentrant; selective checkpointing uses offloadkit's.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from offloadkit.config import ALIASES, OffloadConfig, load_mapping
from offloadkit.integrations.runtime import OffloadRuntime, prepare

__all__ = ["ActivationOffloadingMixin", "LayerOffloadingMixin", "OffloadCallback", "resolve_config"]


def resolve_config(offload_config: Any, args=None, defaults: dict | None = None) -> OffloadConfig:
    """An :class:`OffloadConfig` from a config object, dict, YAML/JSON path or ``None``,
    completed by same-named attributes of the training arguments (``activation_offloading``,
    ``activation_loading_horizon``, SageMaker's ``sm_activation_offloading``, ...) and by
    ``defaults``."""
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
            if target not in data and hasattr(args, key) and key != "gradient_checkpointing":
                data[target] = getattr(args, key)
        if getattr(args, "gradient_checkpointing", False):
            data.setdefault("gradient_checkpointing", True)
    for key, value in (defaults or {}).items():
        data.setdefault(key, value)
    return OffloadConfig.from_dict(data, source="offload config")


def _use_hf_checkpointing(args, config: OffloadConfig) -> OffloadConfig:
    """Hugging Face checkpointing (non-reentrant) for plain checkpointing; offloadkit's for
    selective. Returns the config ``prepare()`` should apply on top of the Trainer's own."""
    if not config.gradient_checkpointing:
        return config
    if config.selective_checkpointing:
        args.gradient_checkpointing = False
        return config
    args.gradient_checkpointing = True
    kwargs = dict(args.gradient_checkpointing_kwargs or {})
    if kwargs.get("use_reentrant", False):
        warnings.warn("offloadkit: use_reentrant=True recomputes under no_grad and saves nothing to offload; "
                      "non-reentrant checkpointing is recommended", UserWarning, stacklevel=3)
    kwargs.setdefault("use_reentrant", False)
    args.gradient_checkpointing_kwargs = kwargs
    return config.replace(gradient_checkpointing=False)


class _OffloadingTrainerMixin:
    """Shared implementation; the public mixins differ only in their defaults."""

    _offload_defaults: dict = {}

    def __init__(self, *args, offload_config: Any = None, **kwargs):
        super().__init__(*args, **kwargs)
        defaults: dict = {}
        for cls in reversed(type(self).__mro__):  # both mixins' defaults when both are used
            defaults.update(cls.__dict__.get("_offload_defaults", {}))
        self.offload_config = resolve_config(offload_config, self.args, defaults)
        self.offload_runtime: OffloadRuntime | None = None
        self.offload_report: dict | None = None

    def train(self, *args, **kwargs):
        config = _use_hf_checkpointing(self.args, self.offload_config)
        self.offload_runtime = prepare(self.model, config)
        try:
            return super().train(*args, **kwargs)
        finally:
            self.offload_report = self.offload_runtime.report()
            self.offload_runtime.close()
            self.offload_runtime = None

    def compute_loss(self, model, inputs, *args, **kwargs):
        runtime = self.offload_runtime
        if runtime is None or runtime.manager is None or not model.training or not torch.is_grad_enabled():
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


try:  # the callback needs transformers; the mixins only need a Trainer to mix into
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # pragma: no cover
    _CallbackBase = object


class OffloadCallback(_CallbackBase):
    """Offloading for a Trainer whose class you cannot change.

    The activation manager is entered around every training forward through model hooks
    (the loss computed inside the model's forward is covered; backward runs outside, as
    usual). Attached at ``on_train_begin``, detached at ``on_train_end``.

    Args:
        offload_config: an :class:`OffloadConfig`, a dict or a YAML/JSON path.
    """

    def __init__(self, offload_config: Any = None):
        self.offload_config = offload_config
        self.runtime: OffloadRuntime | None = None
        self.report: dict | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # Hugging Face checkpointing, when the arguments asked for it, is already on by now;
        # prepare() then leaves checkpointing to it.
        self.runtime = prepare(model, resolve_config(self.offload_config, args))
        self.runtime.attach_to_forward()

    def on_train_end(self, args, state, control, **kwargs):
        if self.runtime is not None:
            self.report = self.runtime.report()
            self.runtime.close()
            self.runtime = None
