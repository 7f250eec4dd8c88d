"""``offloadkit train [CONFIG.yaml]``: fine-tune a causal LM through the Trainer integration,
and show what offloadkit saved and what it cost.

The first ``profile_step + 1`` steps also run without offloadkit (where they fit), measured
the same way; the report puts both side by side and ``memory_timeline.png`` overlays them.
No downloads: the model is a local Hugging Face directory or a built-in Llama shape; the
data is a local ``.txt``/``.jsonl``/``.json`` file or the shipped public-domain corpus.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

from offloadkit.cli.build import load_dtype, load_model, schedule, trainable, training_args, training_data, with_lora
from offloadkit.cli.build import quiet as _quiet  # a module global: tests slip a callback in through it
from offloadkit.cli.errors import TrainingFailedError
from offloadkit.cli.train_config import TrainConfig, default_offload
from offloadkit.extras import check, needs

# Every run goes through the Trainer: say which extra installs it before anything else runs.
check(("transformers", "accelerate"), "offloadkit train")

__all__ = ["TrainConfig", "TrainingFailedError", "TrainingInterrupted", "run_train", "default_offload"]


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; the message says where the run stopped and what was kept."""


class _StopAtStepEnd:
    """The first Ctrl-C ends training at the end of the running step, with a checkpoint of
    it (a ``KeyboardInterrupt`` raised mid-step can land inside any constructor or
    finaliser); a second one stops at once.

    Installed only around ``trainer.train()`` on the main thread, and restored after it.

    Attributes:
        requested: Ctrl-C was pressed.
        saving: the step whose checkpoint is being written, else None (a second Ctrl-C then
            leaves it half-written).
    """

    def __init__(self, log) -> None:
        self.requested = False
        self.saving: int | None = None
        self._log = log
        self._previous = None

    def callback(self):
        with needs("offloadkit train"):
            from transformers import TrainerCallback

        owner = self

        class StopCallback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if owner.requested:
                    control.should_training_stop = True
                    control.should_save = True
                owner.saving = state.global_step if control.should_save else None

            def on_save(self, args, state, control, **kwargs):
                owner.saving = None

        return StopCallback()

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._log(
            "\noffloadkit: stopping at the end of this step, with a checkpoint of it (Ctrl-C again to stop "
            "now, without one)"
        )

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self._previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, self._previous)


def _silent(*args, **kwargs) -> None:
    pass


class _LossWatchdog:
    """``loss_watchdog_threshold``: training stops once the logged loss has stayed above the
    threshold for ``loss_watchdog_patience`` logged steps in a row (3 by default)."""

    def __init__(self, threshold: float, patience: int | None) -> None:
        self.threshold = threshold
        self.patience = patience or 3
        self.above = 0
        self.stopped: tuple[int, float] | None = None

    def callback(self):
        with needs("offloadkit train"):
            from transformers import TrainerCallback

        owner = self

        class LossWatchdogCallback(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                loss = (logs or {}).get("loss")
                if not isinstance(loss, (int, float)):
                    return
                owner.above = owner.above + 1 if loss > owner.threshold else 0
                if owner.above >= owner.patience and owner.stopped is None:
                    owner.stopped = (state.global_step, float(loss))
                    control.should_training_stop = True

        return LossWatchdogCallback()


class _LossGuard:
    """Stops training at the first NaN or infinite logged loss (the Trainer's own filter,
    which would show it as a finite number, is off): such a model is not saved."""

    def __init__(self) -> None:
        self.bad: tuple[int, float] | None = None

    def callback(self):
        with needs("offloadkit train"):
            from transformers import TrainerCallback

        owner = self

        class LossGuardCallback(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                loss = (logs or {}).get("loss")
                if isinstance(loss, (int, float)) and not math.isfinite(loss) and owner.bad is None:
                    owner.bad = (state.global_step, float(loss))
                    control.should_training_stop = True
                    control.should_save = False

        return LossGuardCallback()


def _start_over(work: str) -> None:
    """A new ``--overwrite`` run: clear what a stopped one left in the incomplete-run folder."""
    import shutil

    if os.path.exists(work):
        shutil.rmtree(work)
        print(
            f"offloadkit: removed {work}, an --overwrite run that had stopped: this one starts over "
            "(--resume-from-checkpoint continues it instead)",
            file=sys.stderr,
        )


def _move_into(src: str, dst: str) -> None:
    if os.path.isdir(src) and os.path.isdir(dst) and not os.path.islink(dst):
        # A folder both have that is not part of a run (e.g. TensorBoard's runs/): merge.
        for name in os.listdir(src):
            _move_into(os.path.join(src, name), os.path.join(dst, name))
        os.rmdir(src)
    else:
        os.replace(src, dst)


def _replace_earlier_run(final: str, work: str) -> int:
    """Put the run finished in ``work`` (inside ``final``) in place of ``final``'s earlier run:
    the earlier run's entries move to a backup folder, this run's move in, and the backup is
    deleted. Every step is a rename within one filesystem, so a crash part-way leaves both
    runs (the earlier one in ``replaced-run``); entries that no run wrote stay. Returns the
    number of entries replaced."""
    import shutil

    from offloadkit.cli.preflight import previous_run

    backup = os.path.join(final, "replaced-run")
    if os.path.exists(backup):  # from a replacement cut short, whose new run is gone by now
        shutil.rmtree(backup)
    os.mkdir(backup)
    earlier = previous_run(final)
    for name in earlier:
        os.rename(os.path.join(final, name), os.path.join(backup, name))
    for name in os.listdir(work):
        _move_into(os.path.join(work, name), os.path.join(final, name))
    os.rmdir(work)
    shutil.rmtree(backup)
    return len(earlier)


def _after_stop(work: str, final: str, main: bool) -> str:
    """What a run that stopped before its end left, and how to go on. A stopped ``--overwrite``
    run (``work`` is not ``final``) is removed unless it saved a checkpoint: without one there
    is nothing to continue, and it would only take disk space."""
    import shutil

    with needs("offloadkit train"):
        from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(work) if os.path.isdir(work) else None
    if work == final:
        return f"the last checkpoint is {last}: continue with --resume-from-checkpoint" if last else "nothing was saved"
    if last is None:
        if main:
            shutil.rmtree(work, ignore_errors=True)
        return f"nothing was saved, and the earlier run in {final} is untouched"
    return (
        f"the earlier run in {final} is untouched; this run's last checkpoint is {last}: continue it "
        "with --overwrite --resume-from-checkpoint, or delete it"
    )


def _steps_planned(cfg: TrainConfig, blocks: int) -> int:
    if cfg.max_steps:
        return cfg.max_steps
    batches = blocks // cfg.batch_size if cfg.dataloader_drop_last else math.ceil(blocks / cfg.batch_size)
    per_epoch = max(1, batches // cfg.gradient_accumulation_steps)
    return max(1, math.ceil(per_epoch * cfg.num_epochs))


def _describe(cfg: TrainConfig, name: str, dtype: torch.dtype, cuda: bool, sequences: int | None = None) -> dict:
    off = cfg.offload
    parts = []
    if off.gradient_checkpointing:
        parts.append("gradient checkpointing" + (" (selective)" if off.selective_checkpointing else ""))
    mode = off.activation_offloading
    if mode:
        parts.append(
            {
                True: "activation offloading to pinned RAM (overlapped)",
                "legacy": "activation offloading to RAM (synchronous)",
                "disk": "activation offloading to disk",
            }[mode]
        )
    if off.layer_offloading:
        full_ft = not cfg.lora_rank and off.optimizer_offloading
        what = "layer streaming (trainable weights, updated in backward)" if full_ft else "frozen-layer streaming"
        parts.append(what)
    shape = f"{cfg.batch_size} x {cfg.seq_len}"
    if cfg.gradient_accumulation_steps > 1:
        shape += f" x {cfg.gradient_accumulation_steps} accumulated"
    if sequences is not None and sequences < cfg.batch_size * cfg.gradient_accumulation_steps:
        shape += f", filled with the dataset's {sequences} sequences"
    return {
        "model": name,
        "fine_tune": f"LoRA r={cfg.lora_rank}" if cfg.lora_rank else "full fine-tune",
        "dtype": (
            "float16 mixed precision (fp32 trainable weights, fp16 autocast, loss scaling)"
            if cfg.dtype == "float16"
            else str(dtype).replace("torch.", "")
        ),
        "step_shape": shape,
        "offload_summary": ", ".join(parts) or "nothing (offloading keys all off)",
        "memory_measure": "GPU memory allocated" if cuda else "process RSS",
    }


def _effective_summary(cfg: TrainConfig, report: dict) -> str:
    """What acted on the run (not what was asked for: activation offloading to RAM and
    layer streaming do nothing without a GPU, and the notes say why)."""
    off, acted = cfg.offload, report.get("offload") or {}
    parts = []
    if report.get("checkpointing_active"):
        parts.append("gradient checkpointing" + (" (selective)" if off.selective_checkpointing else ""))
    if "activations" in acted:
        tier = (acted.get("storage") or {}).get("tier", "ram")
        where = {"disk": "to disk", "tiered": "to RAM, then disk past the budget"}.get(tier) or (
            "to RAM (synchronous)" if off.activation_offloading == "legacy" else "to pinned RAM (overlapped)"
        )
        parts.append(f"activation offloading {where}")
    if "layer_streaming" in acted:
        trainable = acted["layer_streaming"].get("trainable")
        parts.append("layer streaming (trainable weights)" if trainable else "frozen-layer streaming")
    if (report.get("memory") or {}).get("optimizer_state_in_host_memory"):
        parts.append("optimizer state in host memory")
    return ", ".join(parts) or "nothing (no memory option acted on this run)"


def _sample(model, tokenizer, prompt: str, seed: int) -> str:
    """A short continuation from the trained model, to see what it learnt."""
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=80, do_sample=True, top_k=10, temperature=0.7, pad_token_id=tokenizer.pad_token_id
        )
    return tokenizer.decode(out[0], skip_special_tokens=True)


def _in_final(path: str, work: str, final: str) -> str:
    """Where ``path``, written in ``work``, will be once the run has ended in ``final``."""
    inside = os.path.realpath(path).startswith(os.path.realpath(work) + os.sep)
    return os.path.join(final, os.path.relpath(path, work)) if work != final and inside else path


def _name_base(model, base_dir: str) -> None:
    """The base a LoRA model's checkpoints and adapter name: where it will be once the run has ended."""
    for peft_config in model.peft_config.values():
        peft_config.base_model_name_or_path = os.path.abspath(base_dir)


def _save(cfg: TrainConfig, model, tokenizer, final: str) -> tuple[str, str]:
    """Save the model or adapter in output_dir; returns where it will be once the run has
    ended (in ``final``) and how to load it."""
    name = "adapter" if cfg.lora_rank else "model"
    if cfg.qat:
        from offloadkit.cli.qat import convert_qat

        convert_qat(model)  # saved as plain linear layers, as Axolotl saves a QAT model
    model.save_pretrained(os.path.join(cfg.output_dir, name))  # offloading is detached by now
    tokenizer.save_pretrained(os.path.join(cfg.output_dir, name))
    save_dir = os.path.join(final, name)
    if cfg.lora_rank:
        return save_dir, f"peft.AutoPeftModelForCausalLM.from_pretrained({save_dir!r})"
    loader = cfg.model_class or _loader_of(model)
    return save_dir, f"transformers.{loader}.from_pretrained({save_dir!r})"


def _loader_of(model) -> str:
    """The auto class that loads ``model``'s saved directory again."""
    from transformers.models.auto import modeling_auto

    config = type(getattr(model, "config", None))
    if config not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING and config in (
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    ):
        return "AutoModelForImageTextToText"
    return "AutoModelForCausalLM"


def run_train(cfg: TrainConfig, log=print) -> dict:
    """Fine-tune as ``cfg`` says; returns the report (also written to ``output_dir``).

    Raises:
        ConfigError: a setting that cannot work, found before the first step.
        TrainingInterrupted: Ctrl-C during training.
        TrainingFailedError: a NaN or infinite training loss (nothing is saved).
    """
    from offloadkit.cli.distributed import Ranks
    from offloadkit.cli.preflight import incomplete_run, preflight, replaces_earlier_run

    wall = time.perf_counter()
    cuda = torch.cuda.is_available()
    cfg = cfg.resolved(cuda)
    preflight(cfg)  # a hub id becomes its cached (or, where allowed, downloaded) snapshot
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # from here on, everything is local
    ranks = Ranks.from_env()
    final = cfg.output_dir
    if replaces_earlier_run(cfg):
        # --overwrite: the earlier run stays whole until this one has saved everything, so a
        # crash or Ctrl-C never leaves output_dir without a run.
        cfg = dataclasses.replace(cfg, output_dir=incomplete_run(final))
        if ranks.main and not cfg.resume_from_checkpoint:
            _start_over(cfg.output_dir)
    try:
        return _run(cfg, final, ranks, cuda, wall, log)
    except KeyboardInterrupt as exc:
        where = str(exc) if isinstance(exc, TrainingInterrupted) else "interrupted"
        raise TrainingInterrupted(f"{where}; {_after_stop(cfg.output_dir, final, ranks.main)}") from None
    except BaseException:
        if cfg.output_dir != final and ranks.main:
            print(f"offloadkit: {_after_stop(cfg.output_dir, final, ranks.main)}", file=sys.stderr)
        raise


@dataclasses.dataclass
class _Steps:
    """The run's steps as the data fills them.

    Attributes:
        profile_step: the step whose memory is sampled (and the last one compared).
        resumed: the step and checkpoint a resumed run continues from, else None.
        sequences: sequences a step trains (fewer than asked for with a small dataset).
        tokens: tokens a step trains.
        notes: what the report says about the run's setup.
    """

    profile_step: int
    resumed: dict | None
    sequences: int
    tokens: int
    notes: list[str]


def _run(cfg: TrainConfig, final: str, ranks, cuda: bool, wall: float, log) -> dict:
    """:func:`run_train` after the checks: train in ``cfg.output_dir``, and end in ``final``.

    The steps: load the model (with its adapters), the data and the step plan; train with
    offloadkit; report; the same first steps without offloadkit; the comparison; write the
    report and the plot, and put the run in ``final``."""
    from offloadkit.cli.distributed import barrier
    from offloadkit.cli.measure import RunMeasure, StepProbe
    from offloadkit.cli.report import ProgressBar, offload_probes

    if not ranks.main:
        log = _silent  # rank 0 speaks for the run
    model, tokenizer, name, dtype = _load(cfg, final, ranks, cuda)
    data = training_data(cfg, tokenizer)
    dataset, collator = data.train, data.collator
    steps = _plan_steps(cfg, final, len(dataset), ranks, data.notes)
    timing = schedule(cfg, len(dataset), ranks.world, _steps_planned(cfg, len(dataset)), data.eval is not None)
    trainer = _offload_trainer(cfg, model, data, cuda, timing, tokenizer)
    with_ = RunMeasure("with offloadkit")
    probe = StepProbe(with_, steps.profile_step, extra=offload_probes(trainer))
    progress = ProgressBar(steps.tokens, with_.step_times, show=ranks.main)
    elapsed = _train(cfg, trainer, probe, progress, ranks.main, cuda)
    report = _report(cfg, trainer, progress, with_, elapsed, steps, name, dtype, cuda, ranks, tokenizer, final)
    # The plain run builds its own optimizer: this one's state must not count against it.
    trainer.accelerator.free_memory()
    trainer.optimizer = trainer.lr_scheduler = None
    del trainer
    without = _without_offloadkit(cfg, model, dataset, collator, steps, report, with_, ranks, cuda)
    title = _compare(report, without, with_, steps.profile_step, name)
    if not ranks.main:
        barrier()  # rank 0 writes the output directory
        return report
    _write(cfg, final, report, without, with_, title, steps.profile_step, wall, log)
    barrier()
    return report


def _load(cfg: TrainConfig, final: str, ranks, cuda: bool):
    """The model on this rank's device, with its LoRA adapters; a built-in base is saved in
    ``output_dir/base`` first, so that the adapter can be used later.

    Returns:
        ``(model, tokenizer, name, dtype)``.
    """
    device = ranks.device(cuda)
    if cuda:
        torch.cuda.set_device(device)
    dtype = load_dtype(cfg, cuda)
    torch.manual_seed(cfg.seed)
    model, tokenizer, name = load_model(cfg, device, dtype)
    if cfg.lora_rank:
        base_dir = None
        if cfg.model is None:
            # The built-in base exists only in this process: save it so the adapter can be used later.
            base_dir = os.path.join(cfg.output_dir, "base")
            if ranks.main and not cfg.load_in_4bit:  # a 4-bit base was saved there before quantising
                model.save_pretrained(base_dir)
                tokenizer.save_pretrained(base_dir)
        model = with_lora(cfg, model)
        if base_dir is not None:
            _name_base(model, os.path.join(final, "base"))
    return trainable(cfg, model), tokenizer, name, dtype


def _plan_steps(cfg: TrainConfig, final: str, sequences: int, ranks, data_notes: list[str]) -> _Steps:
    """The steps the run will take over a dataset of ``sequences``: the step to profile,
    where a resumed run continues, and what a step holds."""
    notes = (
        [f"Axolotl keys that do not change the training, not used: {', '.join(cfg._ignored)}"] if cfg._ignored else []
    )
    if cfg._dropped:
        notes.append(f"trained without (drop_unsupported_keys): {', '.join(cfg._dropped)}")
    notes += data_notes
    planned = _steps_planned(cfg, sequences)
    resumed = None
    if cfg.resume_from_checkpoint:
        # preflight has resolved `true` to the newest checkpoint's directory
        checkpoint = str(cfg.resume_from_checkpoint)
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            done = json.load(f).get("global_step", 0)
        planned = max(1, planned - done)
        resumed = {"step": done, "checkpoint": _in_final(checkpoint, cfg.output_dir, final)}
    profile_step = min(cfg.profile_step, planned - 1)
    if profile_step != cfg.profile_step:
        notes.append(
            f"profile_step {cfg.profile_step} is past the run's {planned} steps; step {profile_step} "
            "is measured instead"
        )
    sequences_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * ranks.world
    if sequences < sequences_per_step:
        # A step cannot be filled: each step trains the whole (small) dataset once.
        notes.append(
            f"the dataset has {sequences} sequences of {cfg.seq_len} tokens, fewer than the {sequences_per_step} "
            f"a step asks for (batch_size x gradient_accumulation_steps x processes): each step trains "
            f"{sequences}; give more text or lower batch_size"
        )
        sequences_per_step = sequences
    return _Steps(profile_step, resumed, sequences_per_step, sequences_per_step * cfg.seq_len, notes)


def _offload_trainer(cfg: TrainConfig, model, data, cuda: bool, timing: dict, tokenizer=None):
    """The Trainer with offloadkit's mixin, as ``cfg.offload`` sets it up; ``timing``: the
    save and evaluation steps of :func:`~offloadkit.cli.build.schedule`."""
    trainer = _trainer(cfg, model, data, cuda, timing, tokenizer)
    trainer.quadratic_warmup = bool(cfg.lr_quadratic_warmup)
    if cfg.lisa_n_layers:
        trainer.add_callback(_lisa(cfg, model))
    if cfg.qat and cfg.qat.get("fake_quant_after_n_steps") is not None:
        from offloadkit.cli.qat import fake_quant_switch

        trainer.add_callback(fake_quant_switch(cfg.qat["fake_quant_after_n_steps"]))
    if cfg.early_stopping_patience:
        from transformers import EarlyStoppingCallback

        trainer.add_callback(EarlyStoppingCallback(cfg.early_stopping_patience))
    return trainer


def _lisa(cfg: TrainConfig, model):
    """LISA: every ``lisa_step_interval`` steps (and at step 1, as Axolotl), only
    ``lisa_n_layers`` decoder layers drawn at random (seeded) train; the rest of the model keeps
    training."""
    import functools
    import random

    from transformers import TrainerCallback

    from offloadkit.config import ConfigError

    try:
        layers = functools.reduce(getattr, cfg.lisa_layers_attribute.split("."), model)
        count = len(layers)
    except (AttributeError, TypeError):
        raise ConfigError(
            f"{cfg.name('lisa_layers_attribute')}={cfg.lisa_layers_attribute!r} names no list of layers of "
            f"{type(model).__name__}"
        ) from None
    if cfg.lisa_n_layers > count:
        raise ConfigError(
            f"{cfg.name('lisa_n_layers')}={cfg.lisa_n_layers} is more than the model's {count} layers; lower it"
        )
    draw = random.Random(cfg.seed)
    interval, n = cfg.lisa_step_interval, cfg.lisa_n_layers

    class LISA(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step % interval == 0 or state.global_step == 1:
                chosen = set(draw.sample(range(count), n))
                for index, layer in enumerate(layers):
                    layer.requires_grad_(index in chosen)

    return LISA()


class _QuadraticWarmup:
    """``lr_quadratic_warmup``: the cosine schedule with its warmup factor squared, (step /
    warmup)**2, then the cosine down to 0 over the remaining steps."""

    quadratic_warmup = False
    # Provided by the Trainer this is mixed into.
    args: Any
    optimizer: Any
    lr_scheduler: Any

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if not self.quadratic_warmup or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer=optimizer)  # type: ignore[misc]
        from torch.optim.lr_scheduler import LambdaLR

        warmup = self.args.get_warmup_steps(num_training_steps)

        def factor(step: int) -> float:
            if step < warmup:
                return (step / max(1, warmup)) ** 2
            progress = (step - warmup) / max(1, num_training_steps - warmup)
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

        self.lr_scheduler = LambdaLR(optimizer if optimizer is not None else self.optimizer, factor)
        self._created_lr_scheduler = True
        return self.lr_scheduler


def _trainer(cfg: TrainConfig, model, data, cuda: bool, timing: dict, tokenizer):
    """The Trainer of ``cfg``'s training: TRL's DPO or reward trainer, else the Trainer."""
    with needs("offloadkit train"):
        from transformers import Trainer

    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    if cfg.rl in ("dpo", "kto"):
        return _quiet(_dpo_trainer(cfg, model, data, tokenizer, training_args(cfg, cuda, **timing)))
    if cfg.reward_model:
        with needs("offloadkit train"):
            from trl import RewardTrainer

        class OffloadRewardTrainer(ActivationOffloadingMixin, _QuadraticWarmup, RewardTrainer):
            pass

        return _quiet(
            OffloadRewardTrainer(
                model=model,
                args=training_args(cfg, cuda, **timing),
                train_dataset=data.train,
                eval_dataset=data.eval,
                processing_class=tokenizer,
                offload_config=cfg.offload,
            )
        )

    class OffloadTrainer(ActivationOffloadingMixin, _QuadraticWarmup, Trainer):
        pass

    return _quiet(
        OffloadTrainer(
            model=model,
            args=training_args(cfg, cuda, **timing),
            train_dataset=data.train,
            eval_dataset=data.eval,
            data_collator=data.collator,
            offload_config=cfg.offload,
        )
    )


def _dpo_trainer(cfg: TrainConfig, model, data, tokenizer, args):
    """TRL's DPO (or KTO) trainer with offloadkit's mixin. The reference policy is the model before
    training: with LoRA a frozen copy of the adapters as they start (TRL's own way), else a
    frozen copy of the weights as loaded."""
    import copy

    with needs("offloadkit train"):
        from trl import DPOTrainer, KTOTrainer

    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    class OffloadDPOTrainer(ActivationOffloadingMixin, _QuadraticWarmup, DPOTrainer):
        pass

    class OffloadKTOTrainer(ActivationOffloadingMixin, _QuadraticWarmup, KTOTrainer):
        pass

    ref_model = None
    if not cfg.lora_rank:
        ref_model = copy.deepcopy(model).eval()
        ref_model.requires_grad_(False)
    trainer_class = OffloadKTOTrainer if cfg.rl == "kto" else OffloadDPOTrainer
    return trainer_class(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
        offload_config=cfg.offload,
    )


def _train(cfg: TrainConfig, trainer, probe, progress, main: bool, cuda: bool) -> float:
    """Train, measured by ``probe`` and shown by ``progress``; the first Ctrl-C stops at the
    end of a step with a checkpoint of it, and a NaN or infinite loss stops training. Only
    the main process (``main``) speaks.

    Returns:
        The seconds training took.

    Raises:
        TrainingInterrupted: Ctrl-C.
        TrainingFailedError: a NaN or infinite training loss.
    """
    stop = _StopAtStepEnd(lambda message: main and print(message, file=sys.stderr, flush=True))
    guard = _LossGuard()
    trainer.add_callback(probe)
    trainer.add_callback(progress)
    trainer.add_callback(stop.callback())
    trainer.add_callback(guard.callback())
    watchdog = None
    if cfg.loss_watchdog_threshold is not None:
        watchdog = _LossWatchdog(cfg.loss_watchdog_threshold, cfg.loss_watchdog_patience)
        trainer.add_callback(watchdog.callback())
        trainer._offloadkit_watchdog = watchdog  # the report says when it stopped the run
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        with stop.installed():
            trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
        if stop.requested:
            raise KeyboardInterrupt
    except BaseException as exc:
        progress.close()  # whatever is printed next starts on its own line
        probe.stop()
        if isinstance(exc, KeyboardInterrupt) and stop.saving is not None:
            # A second Ctrl-C while a checkpoint was written: `--resume-from-checkpoint` would pick it.
            import shutil

            shutil.rmtree(os.path.join(cfg.output_dir, f"checkpoint-{stop.saving}"), ignore_errors=True)
        if isinstance(exc, KeyboardInterrupt):
            raise TrainingInterrupted(f"interrupted at step {progress.step} of {progress.total}") from None
        raise
    elapsed = time.perf_counter() - start
    if guard.bad is not None:
        progress.close()
        probe.stop()
        step, value = guard.bad
        hint = (
            "lower learning_rate, or use dtype: bfloat16"
            if cfg.dtype == "float16"
            else "lower learning_rate, or check the data"
        )
        raise TrainingFailedError(
            f"the training loss is {value} at step {step}: training stopped and no model was saved; {hint}"
        )
    return elapsed


def _report(
    cfg: TrainConfig,
    trainer,
    progress,
    with_,
    elapsed: float,
    steps: _Steps,
    name: str,
    dtype,
    cuda: bool,
    ranks,
    tokenizer,
    final: str,
) -> dict:
    """The run's report (the comparison comes later); the main process saves the model or
    adapter, and a built-in model on the shipped corpus writes a sample."""
    from offloadkit.cli.distributed import gather, rank_figures
    from offloadkit.cli.report import build_report

    report = build_report(
        trainer, progress.losses, with_, elapsed, steps.tokens, _describe(cfg, name, dtype, cuda, steps.sequences)
    )
    report["profile_step"] = steps.profile_step
    report["resumed_from"] = steps.resumed
    evaluations = [
        {"step": entry.get("step"), "eval_loss": entry["eval_loss"]}
        for entry in trainer.state.log_history
        if "eval_loss" in entry
    ]
    if evaluations:
        report["evaluations"] = evaluations
    watchdog = getattr(trainer, "_offloadkit_watchdog", None)
    if watchdog is not None and watchdog.stopped is not None:
        step, loss = watchdog.stopped
        steps.notes.append(
            f"{cfg.name('loss_watchdog_threshold')}: training stopped at step {step}, the loss ({loss:.3g}) above "
            f"{cfg.loss_watchdog_threshold} for {watchdog.patience} logged steps"
        )
    report["offload_summary"] = _effective_summary(cfg, report)
    report["notes"] = steps.notes + report["notes"]
    report["world_size"] = trainer.args.world_size  # the Trainer's own view of the process group
    report["parallel"] = (
        "fsdp"
        if getattr(trainer, "is_fsdp_enabled", False)
        else "deepspeed"
        if getattr(trainer, "is_deepspeed_enabled", False)
        else "ddp"
        if trainer.args.world_size > 1
        else "one process"
    )
    if ranks.distributed:
        report["step_shape"] = f"{ranks.world} processes x {report['step_shape']}"
    report["ranks"] = gather(rank_figures(report, ranks))
    if ranks.main:
        report["saved_to"], report["load_hint"] = _save(cfg, trainer.model, tokenizer, final)
        if cfg.model is None and cfg.dataset is None and not cfg.datasets:
            from offloadkit.data import load_texts

            try:
                report["sample"] = _sample(trainer.model, tokenizer, load_texts()[0][:15], cfg.seed)
            except (RuntimeError, AssertionError) as exc:  # bitsandbytes' CPU inference needs larger layers
                report["notes"].append(f"no sample from the trained model: {' '.join(str(exc).split())[:120]}")
    return report


def _without_offloadkit(cfg: TrainConfig, model, dataset, collator, steps: _Steps, report: dict, with_, ranks, cuda):
    """The first steps again without offloadkit, measured as the run was (here on a GPU, in a
    process of its own on a CPU), or why not."""
    with needs("offloadkit train"):
        from transformers import Trainer

    from offloadkit.cli.compare import measure_in_own_process, measure_without_offloadkit
    from offloadkit.cli.measure import RunMeasure

    profile_step = steps.profile_step

    def plain_trainer(max_steps, callbacks):
        args = training_args(
            cfg, cuda, max_steps=max_steps, save_strategy="no", report_to="none", logging_strategy="no"
        )
        return _quiet(
            Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=callbacks)
        )

    if ranks.distributed:
        # A rank that runs out of memory alone would leave the others waiting in a collective.
        return RunMeasure(
            "without offloadkit", status="skipped", note=f"a {ranks.world}-process run; run one process to compare"
        )
    if (cfg.rl or cfg.reward_model) and cfg.compare:
        what = f"{cfg.name('rl')}: {cfg.rl}" if cfg.rl else f"{cfg.name('reward_model')}: true"
        return RunMeasure(
            "without offloadkit",
            status="skipped",
            note=f"{what}: the plain run it would be compared with is not built for preference or reward training",
        )
    if report["offload_summary"].startswith("nothing"):
        return RunMeasure(
            "without offloadkit",
            status="skipped",
            note="no memory option acted on this run, so it is the run without offloadkit",
        )
    if cfg.compare and len(with_.step_times) > profile_step:
        print(
            f"offloadkit: measuring steps 0-{profile_step} again without offloadkit, for comparison (Ctrl-C skips it)",
            file=sys.stderr,
        )
        try:
            if cuda:
                return measure_without_offloadkit(plain_trainer, model, profile_step, steps.tokens)
            # RSS never falls: the plain run gets a fresh process, as the real run had.
            return measure_in_own_process(cfg, profile_step, steps.tokens)
        except KeyboardInterrupt:
            # The run itself is finished and saved: keep its report and plot.
            return RunMeasure("without offloadkit", status="skipped", note="interrupted (Ctrl-C)")
    return RunMeasure(
        "without offloadkit",
        status="skipped",
        note="compare: false" if not cfg.compare else "the run was shorter than the profiled step",
    )


def _compare(report: dict, without, with_, profile_step: int, name: str) -> str:
    """Put both runs and their comparison in the report; returns the plot's title."""
    from offloadkit.cli.compare import saving

    report["comparison"] = saving(without, with_, profile_step)
    report["runs"] = {"without": without.as_dict(), "with": with_.as_dict()}
    c = report["comparison"]
    title = f"offloadkit train, {name}: step {profile_step}"
    if c["status"] == "ok" and None not in c["peak_bytes"]:
        change = "" if c["peak_change"] is None else f" ({c['peak_change'] * 100:+.0f}%)"
        title += (
            f"\npeak {c['peak_bytes'][0] / 2**30:.3f} -> {c['peak_bytes'][1] / 2**30:.3f} GiB{change}, "
            f"step time {c['median_step_s'][0]:.3f} -> {c['median_step_s'][1]:.3f} s, without -> with offloadkit"
        )
    return title


def _write(cfg: TrainConfig, final: str, report: dict, without, with_, title: str, profile_step: int, wall: float, log):
    """The main process's end of the run: the memory plot and the report in ``output_dir``,
    which then takes the place of an earlier run in ``final`` (``--overwrite``)."""
    from offloadkit.cli.plot import plot_timelines
    from offloadkit.cli.report import write_report

    plot, report["plot_note"] = plot_timelines(
        [without, with_],
        os.path.join(cfg.output_dir, "memory_timeline.png"),
        title=title,
        memory_label=report["memory_measure"],
        profile_step=profile_step,
        steps_run=len(with_.step_times),
    )
    report["memory_plot"] = plot and os.path.join(final, os.path.basename(plot))
    report["wall_seconds"] = time.perf_counter() - wall
    text = write_report(report, cfg.output_dir, _silent, shown_dir=final)
    if cfg.output_dir != final:
        replaced = _replace_earlier_run(final, cfg.output_dir)
        print(
            f"offloadkit: replaced the earlier run in {final} ({replaced} entries): overwrite_output_dir",
            file=sys.stderr,
        )
    log(text)
