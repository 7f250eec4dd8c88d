"""Checks of ``offloadkit train`` that depend on this machine, run before the model loads:
paths that must be writable or readable, packages that must be installed, and a
checkpoint to resume from. Each failure is one :class:`ConfigError` line naming the key,
the value and the fix, so nothing is lost at the end of a run."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings

from offloadkit.config import ConfigError, ConfigProblemsError, check_writable_dir
from offloadkit.data.text import FORMATS

__all__ = [
    "preflight",
    "optimizer_package",
    "previous_run",
    "incomplete_run",
    "replaces_earlier_run",
    "INCOMPLETE_RUN",
    "TOKENIZER_FILES",
]

# Where an --overwrite run trains while output_dir still holds the earlier run (inside
# output_dir: a rename into it never crosses filesystems, even when it is a mount point).
INCOMPLETE_RUN = "incomplete-run"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Optimizers of the Trainer that need a package of their own: (name test, package, install).
_OPTIMIZER_PACKAGES = (
    (lambda name: name in ("adamw_torch_4bit", "adamw_torch_8bit"), "torchao", "pip install torchao"),
    (lambda name: name.startswith("galore_"), "galore_torch", "pip install galore-torch"),
    (lambda name: name.startswith("apollo_"), "apollo_torch", "pip install apollo-torch"),
    (lambda name: name.startswith("schedule_free_"), "schedulefree", "pip install schedulefree"),
    (lambda name: name in ("lomo", "adalomo"), "lomo_optim", "pip install lomo-optim"),
    (lambda name: name == "grokadamw", "grokadamw", "pip install grokadamw"),
    (lambda name: name == "stable_adamw", "optimi", "pip install torch-optimi"),
    (lambda name: name == "adamw_anyprecision", "torchdistx", "pip install torchdistx"),
    (
        lambda name: any(tag in name for tag in ("bnb", "8bit", "paged_", "lion", "ademamix")),
        "bitsandbytes",
        "pip install bitsandbytes",
    ),
)


def optimizer_package(name: str) -> tuple[str, str] | None:
    """The package (and its install command) the Trainer's optimizer ``name`` needs, or None."""
    for test, package, install in _OPTIMIZER_PACKAGES:
        if test(name):
            return package, install
    return None


def previous_run(output_dir: str) -> list[str]:
    """What an earlier ``offloadkit train`` left in ``output_dir``: its report, saved model or
    adapter, and checkpoints (names relative to the directory, sorted)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if name in ("report.json", "report.md", "memory_timeline.png") and os.path.isfile(path):
            found.append(name)
        elif name in ("model", "adapter", "base") and os.path.isdir(path):
            found.append(name)
        elif name.startswith("checkpoint-") and os.path.isdir(path):
            found.append(name)
    return found


def incomplete_run(output_dir: str) -> str:
    """The folder an ``--overwrite`` run trains in until it has saved (see :data:`INCOMPLETE_RUN`)."""
    return os.path.join(output_dir, INCOMPLETE_RUN)


def replaces_earlier_run(cfg) -> bool:
    """Whether this run trains in :func:`incomplete_run` and takes the earlier run's place in
    output_dir only once it has saved: ``overwrite_output_dir`` over an earlier run, or the
    continuation of such a run that stopped (resumed from a checkpoint in that folder)."""
    if not cfg.overwrite_output_dir:
        return False
    if cfg.resume_from_checkpoint:
        staged = os.path.realpath(incomplete_run(cfg.output_dir))
        return os.path.realpath(str(cfg.resume_from_checkpoint)).startswith(staged + os.sep)
    return bool(previous_run(cfg.output_dir))


def _output_dir(cfg) -> None:
    check_writable_dir(
        cfg.output_dir,
        cfg.name("output_dir"),
        "choose a writable directory (it is created if missing), e.g. --output-dir ./out",
    )
    if cfg.resume_from_checkpoint or cfg.overwrite_output_dir:
        return
    if cfg.auto_resume_from_checkpoints and _last_checkpoint(cfg.output_dir):
        return  # continued from its newest checkpoint
    found = previous_run(cfg.output_dir)
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ConfigError(
            f"{cfg.name('output_dir')}={cfg.output_dir!r} holds an earlier run ({shown}); choose "
            "another output_dir, continue it with --resume-from-checkpoint, or replace it with "
            "--overwrite (overwrite_output_dir: true)"
        )


def _hub_ids(cfg) -> None:
    """Hub ids (``org/name``) of the model, tokenizer and adapter, as local directories: the
    snapshot in the local Hugging Face cache, or a download when the network is allowed."""
    from offloadkit.integrations.hub import looks_like_hub_id, resolve

    for field, revision in (("model", cfg.model_revision), ("tokenizer", None), ("lora_model_dir", None)):
        value = getattr(cfg, field)
        if isinstance(value, str) and looks_like_hub_id(value):
            setattr(cfg, field, resolve(value, cfg.name(field), revision=revision if field == "model" else None))


def _model(cfg) -> None:
    if cfg.model is None:
        return
    key = cfg.name("model")
    if not os.path.isdir(cfg.model):
        raise ConfigError(
            f"{key}={cfg.model!r} is not a directory; give a local Hugging Face model directory "
            "(offloadkit train does not download) or omit it for the built-in model"
        )
    if not os.path.isfile(os.path.join(cfg.model, "config.json")):
        raise ConfigError(
            f"{key}={cfg.model!r} has no config.json; give a directory written by model.save_pretrained(...)"
        )
    tokenizer = cfg.tokenizer or cfg.model
    if not os.path.isdir(tokenizer) or not any(os.path.isfile(os.path.join(tokenizer, f)) for f in TOKENIZER_FILES):
        tkey = cfg.name("tokenizer") if cfg.tokenizer else key
        raise ConfigError(
            f"{tkey}={tokenizer!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save "
            f"one there with tokenizer.save_pretrained(...), or set tokenizer: DIR"
        )


def _datasets(cfg) -> None:
    from offloadkit.data.sft import check_path

    problems = []
    for i, spec in enumerate(cfg.dataset_specs() if cfg.datasets else []):
        why = check_path(spec)
        if why is not None:
            problems.append((f"{cfg.name('datasets')}[{i}].path={spec.path!r} {why}", False))
        elif spec.type == "chat_template" and not _has_template(cfg):
            problems.append(
                (
                    f"{cfg.name('datasets')}[{i}] is type chat_template but the tokenizer has no chat "
                    "template; set chat_template: chatml (or a Jinja template), or give a tokenizer with "
                    "one",
                    False,
                )
            )
    if problems:
        raise ConfigProblemsError("datasets", problems)


def _adapter_dir(cfg) -> None:
    if cfg.lora_model_dir is None:
        return
    if not os.path.isfile(os.path.join(cfg.lora_model_dir, "adapter_config.json")):
        raise ConfigError(
            f"{cfg.name('lora_model_dir')}={cfg.lora_model_dir!r} holds no adapter_config.json; give a directory "
            "written by a PEFT model's save_pretrained(...)"
        )


def _has_template(cfg) -> bool:
    if (
        cfg.chat_template in ("chatml", "tokenizer_default_fallback_chatml")
        or (cfg.chat_template and "{" in cfg.chat_template)
        or cfg.model is None
    ):
        return True  # the built-in byte tokenizer has ChatML
    folder = cfg.tokenizer or cfg.model
    if any(os.path.isfile(os.path.join(folder, f)) for f in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def _attention(cfg) -> None:
    """An attention kernel that is not installed here falls back to sdpa, with a warning."""
    name = cfg.attn_implementation
    if name in (None, "sdpa", "eager") or (name == "flex_attention" and _cuda()):
        return
    needs = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}.get(name)
    if needs is not None and importlib.util.find_spec(needs) is not None and _cuda():
        return
    why = (
        "PyTorch's FlexAttention has no backward on a CPU"
        if name == "flex_attention"
        else f"{needs} is not installed"
        if needs and importlib.util.find_spec(needs) is None
        else "it needs a CUDA GPU"
        if needs
        else "it is not a kernel transformers has built in (no downloads)"
    )
    warnings.warn(
        f"offloadkit: {cfg.name('attn_implementation')}={name!r} has no effect here: {why}; the model "
        "uses attn_implementation='sdpa'",
        UserWarning,
        stacklevel=3,
    )
    cfg.attn_implementation = "sdpa"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _dataset(cfg) -> None:
    if cfg.dataset is None:
        return
    key = cfg.name("dataset")
    if not os.path.isfile(cfg.dataset):
        raise ConfigError(
            f"{key}={cfg.dataset!r} does not exist; give a local {', '.join(FORMATS)} file "
            "(offloadkit train does not download) or omit it for the shipped corpus"
        )
    ext = os.path.splitext(cfg.dataset)[1].lower()
    if ext not in FORMATS:
        raise ConfigError(
            f"{key}={cfg.dataset!r} is a {ext or 'extension-less'} file; offloadkit train reads "
            f"{', '.join(FORMATS)}: convert it to JSON Lines with a {cfg.text_field!r} field"
        )


def _packages(cfg) -> None:
    if cfg.lora_rank and importlib.util.find_spec("peft") is None:
        raise ConfigError(f"{cfg.name('lora_rank')}={cfg.lora_rank} needs PEFT: pip install 'offloadkit[hf]'")
    if cfg.load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"{cfg.name('load_in_4bit')}=true (QLoRA) needs bitsandbytes: pip install bitsandbytes")
    if cfg.load_in_8bit and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"{cfg.name('load_in_8bit')}=true needs bitsandbytes: pip install bitsandbytes")
    import transformers

    for key in ("model_class", "tokenizer_type", "model_quantization_config"):
        name = getattr(cfg, key)
        if name is not None and not hasattr(transformers, name):
            raise ConfigError(
                f"{cfg.name(key)}={name!r} is not a class of the installed transformers "
                f"({transformers.__version__}); give one it has, or leave it out for the Auto class"
            )
    from transformers.training_args import OptimizerNames

    names = [o.value for o in OptimizerNames]
    if cfg.optimizer not in names:
        raise ConfigError(
            f"{cfg.name('optimizer')}={cfg.optimizer!r} is not an optimizer the Trainer knows; use "
            "adamw_torch, adamw_torch_fused, sgd, adafactor or another of transformers' OptimizerNames"
        )
    needs = optimizer_package(cfg.optimizer)
    if needs is not None and importlib.util.find_spec(needs[0]) is None:
        raise ConfigError(
            f"{cfg.name('optimizer')}={cfg.optimizer!r} needs {needs[0]}: {needs[1]}, or use optimizer: adamw_torch"
        )
    reporters = [cfg.report_to] if isinstance(cfg.report_to, str) else list(cfg.report_to)
    reporters = [r for r in reporters if r != "none"]
    if reporters:
        from transformers.integrations import get_available_reporting_integrations

        available = get_available_reporting_integrations()
        missing = [r for r in reporters if r not in available]
        if missing:
            hint = "pip install tensorboard" if missing == ["tensorboard"] else f"install {', '.join(missing)}"
            raise ConfigError(
                f"{cfg.name('report_to')}={cfg.report_to!r}: {', '.join(missing)} is not installed; "
                f"{hint}, or set report_to: none"
            )


def _resume(cfg) -> None:
    if cfg.auto_resume_from_checkpoints and cfg.resume_from_checkpoint in (None, False):
        # Axolotl's auto-resume: the newest checkpoint when there is one, else a fresh start.
        cfg.resume_from_checkpoint = True if _last_checkpoint(cfg.output_dir) else None
    value = cfg.resume_from_checkpoint
    if value in (None, False):
        cfg.resume_from_checkpoint = None
        return
    key = cfg.name("resume_from_checkpoint")
    if value is True:
        staged = _last_checkpoint(incomplete_run(cfg.output_dir))
        # With --overwrite, the run that stopped before replacing the earlier one is continued.
        last = staged if cfg.overwrite_output_dir and staged else _last_checkpoint(cfg.output_dir)
        if last is None:
            fix = (
                f"continue the stopped --overwrite run in {incomplete_run(cfg.output_dir)!r} with --overwrite "
                "--resume-from-checkpoint"
                if staged
                else "set save_steps to write checkpoints, or give the checkpoint directory"
            )
            raise ConfigError(f"{key}=true but output_dir={cfg.output_dir!r} holds no checkpoint-N directory; {fix}")
        cfg.resume_from_checkpoint = last
        value = last
    state = os.path.join(value, "trainer_state.json")
    if not os.path.isfile(state):
        raise ConfigError(
            f"{key}={value!r} is not a Trainer checkpoint (no trainer_state.json); give a "
            "checkpoint-N directory written with save_steps, or true for the newest in output_dir"
        )
    try:
        with open(state, encoding="utf-8") as f:
            done = int(json.load(f).get("global_step", 0))
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{key}={value!r}: trainer_state.json cannot be read ({exc})") from None
    if cfg.max_steps and done >= cfg.max_steps:
        raise ConfigError(
            f"{key}={value!r} is at step {done} and {cfg.name('max_steps')} is {cfg.max_steps}: there "
            f"is nothing left to train; raise max_steps past {done} (e.g. --max-steps {done + 100})"
        )


def _last_checkpoint(folder: str) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(folder) if os.path.isdir(folder) else None


def preflight(cfg) -> None:
    """Check everything that can be checked before loading anything; may resolve
    ``resume_from_checkpoint: true`` to the newest checkpoint directory.

    Args:
        cfg: a validated :class:`~offloadkit.cli.train_config.TrainConfig`.

    Raises:
        ConfigError: the problem found, or ConfigProblemsError with every one found.
    """
    problems: list[tuple[str, bool]] = []
    for check in (
        _output_dir,
        _hub_ids,
        _model,
        _adapter_dir,
        _dataset,
        _datasets,
        _packages,
        _resume,
        lambda c: c.offload.check_paths(),
        _attention,
    ):
        try:
            check(cfg)
        except ConfigProblemsError as exc:
            problems += exc.problems
        except ConfigError as exc:
            problems.append((str(exc), False))
    if len(problems) == 1:
        raise ConfigError(problems[0][0])
    if problems:
        raise ConfigProblemsError("preflight", problems)  # every problem found, at once
