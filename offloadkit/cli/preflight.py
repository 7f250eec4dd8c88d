"""Checks of ``offloadkit train`` that depend on this machine, run before the model loads:
paths that must be writable or readable, packages that must be installed, and a
checkpoint to resume from. Each failure is one :class:`ConfigError` line naming the key,
the value and the fix, so nothing is lost at the end of a run."""

from __future__ import annotations

import importlib.util
import os

from offloadkit.config import ConfigError, check_writable_dir
from offloadkit.data.text import FORMATS

__all__ = ["preflight", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_NEEDS_BNB = ("bnb", "8bit", "paged_", "lion_32bit")


def _output_dir(cfg) -> None:
    check_writable_dir(cfg.output_dir, cfg.name("output_dir"),
                       "choose a writable directory (it is created if missing), e.g. --output-dir ./out")


def _model(cfg) -> None:
    if cfg.model is None:
        return
    key = cfg.name("model")
    if not os.path.isdir(cfg.model):
        raise ConfigError(f"{key}={cfg.model!r} is not a directory; give a local Hugging Face model directory "
                          "(offloadkit train does not download) or omit it for the built-in model")
    if not os.path.isfile(os.path.join(cfg.model, "config.json")):
        raise ConfigError(f"{key}={cfg.model!r} has no config.json; give a directory written by "
                          "model.save_pretrained(...)")
    tokenizer = cfg.tokenizer or cfg.model
    if not os.path.isdir(tokenizer) or not any(os.path.isfile(os.path.join(tokenizer, f)) for f in TOKENIZER_FILES):
        tkey = cfg.name("tokenizer") if cfg.tokenizer else key
        raise ConfigError(f"{tkey}={tokenizer!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save "
                          f"one there with tokenizer.save_pretrained(...), or set tokenizer: DIR")


def _dataset(cfg) -> None:
    if cfg.dataset is None:
        return
    key = cfg.name("dataset")
    if not os.path.isfile(cfg.dataset):
        raise ConfigError(f"{key}={cfg.dataset!r} does not exist; give a local {', '.join(FORMATS)} file "
                          "(offloadkit train does not download) or omit it for the shipped corpus")
    ext = os.path.splitext(cfg.dataset)[1].lower()
    if ext not in FORMATS:
        raise ConfigError(f"{key}={cfg.dataset!r} is a {ext or 'extension-less'} file; offloadkit train reads "
                          f"{', '.join(FORMATS)}: convert it to JSON Lines with a {cfg.text_field!r} field")


def _packages(cfg) -> None:
    if cfg.lora_rank and importlib.util.find_spec("peft") is None:
        raise ConfigError(f"{cfg.name('lora_rank')}={cfg.lora_rank} needs PEFT: pip install 'offloadkit[hf]'")
    from transformers.training_args import OptimizerNames

    names = [o.value for o in OptimizerNames]
    if cfg.optimizer not in names:
        raise ConfigError(f"{cfg.name('optimizer')}={cfg.optimizer!r} is not an optimizer the Trainer knows; use "
                          "adamw_torch, adamw_torch_fused, sgd, adafactor or another of transformers' OptimizerNames")
    if any(tag in cfg.optimizer for tag in _NEEDS_BNB) and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"{cfg.name('optimizer')}={cfg.optimizer!r} needs bitsandbytes: pip install bitsandbytes, "
                          "or use optimizer: adamw_torch")
    reporters = [cfg.report_to] if isinstance(cfg.report_to, str) else list(cfg.report_to)
    reporters = [r for r in reporters if r != "none"]
    if reporters:
        from transformers.integrations import get_available_reporting_integrations

        available = get_available_reporting_integrations()
        missing = [r for r in reporters if r not in available]
        if missing:
            hint = "pip install tensorboard" if missing == ["tensorboard"] else f"install {', '.join(missing)}"
            raise ConfigError(f"{cfg.name('report_to')}={cfg.report_to!r}: {', '.join(missing)} is not installed; "
                              f"{hint}, or set report_to: none")


def _resume(cfg) -> None:
    value = cfg.resume_from_checkpoint
    if value in (None, False):
        cfg.resume_from_checkpoint = None
        return
    key = cfg.name("resume_from_checkpoint")
    if value is True:
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(cfg.output_dir) if os.path.isdir(cfg.output_dir) else None
        if last is None:
            raise ConfigError(f"{key}=true but output_dir={cfg.output_dir!r} holds no checkpoint-N directory; set "
                              "save_steps to write checkpoints, or give the checkpoint directory")
        cfg.resume_from_checkpoint = last
        return
    if not os.path.isfile(os.path.join(value, "trainer_state.json")):
        raise ConfigError(f"{key}={value!r} is not a Trainer checkpoint (no trainer_state.json); give a "
                          "checkpoint-N directory written with save_steps, or true for the newest in output_dir")


def preflight(cfg) -> None:
    """Check everything that can be checked before loading anything; may resolve
    ``resume_from_checkpoint: true`` to the newest checkpoint directory.

    Args:
        cfg: a validated :class:`~offloadkit.cli.train_config.TrainConfig`.

    Raises:
        ConfigError: the first problem found.
    """
    _output_dir(cfg)
    _model(cfg)
    _dataset(cfg)
    _packages(cfg)
    _resume(cfg)
    cfg.offload.check_paths()
