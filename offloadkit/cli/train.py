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

import torch

from offloadkit.cli.errors import TrainingFailedError
from offloadkit.cli.train_config import TrainConfig, default_offload
from offloadkit.config import ConfigError

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


class _LossGuard:
    """Stops training at the first NaN or infinite logged loss (the Trainer's own filter,
    which would show it as a finite number, is off): such a model is not saved."""

    def __init__(self) -> None:
        self.bad: tuple[int, float] | None = None

    def callback(self):
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


def load_dtype(cfg: TrainConfig, cuda: bool) -> torch.dtype:
    """The dtype the weights are loaded in. float16 is mixed precision, as the Trainer's and
    Axolotl's fp16: what trains is fp32 (full fine-tune: every weight; LoRA: the adapters,
    which PEFT keeps in fp32 over an fp16 frozen base), under fp16 autocast with a loss
    scaler. fp16 weights trained with AdamW directly overflow within steps."""
    if cfg.dtype == "float16":
        frozen_base = cfg.lora_rank and not cfg.lora_modules_to_save
        return torch.float16 if frozen_base else torch.float32
    return {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16, "float32": torch.float32}[
        cfg.dtype
    ]


def _load_model(cfg: TrainConfig, device: str, dtype: torch.dtype):
    from offloadkit.data import BYTE_VOCAB_SIZE, byte_tokenizer
    from offloadkit.models.zoo import build_llama

    if cfg.load_in_4bit:
        return _load_4bit(cfg, device, dtype)
    attention = cfg.attn_implementation or "sdpa"
    if cfg.model is None:
        # The vocabulary is the byte tokenizer's: ids past it would never be trained.
        model = build_llama(
            cfg.model_shape,
            dtype=dtype,
            device=device,
            seed=cfg.seed,
            attn_implementation=attention,
            vocab_size=BYTE_VOCAB_SIZE,
            max_position_embeddings=max(cfg.seq_len, 2048),
        )
        return model, _with_template(cfg, byte_tokenizer()), f"built-in '{cfg.model_shape}' Llama (random init)"
    from transformers import AutoModelForCausalLM

    tokenizer = _load_tokenizer(cfg)
    try:
        kwargs = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype, local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{cfg.name('model')}={cfg.model!r} could not be loaded as a local Hugging Face model "
            f"({' '.join(str(exc).split())})"
        ) from None
    return model.to(device), _with_template(cfg, tokenizer), cfg.model  # type: ignore[arg-type]


def _load_tokenizer(cfg: TrainConfig):
    from transformers import AutoTokenizer

    tokenizer_dir = cfg.tokenizer or cfg.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{cfg.name('tokenizer') if cfg.tokenizer else cfg.name('model')}={tokenizer_dir!r}: "
            f"the tokenizer could not be loaded ({' '.join(str(exc).split())})"
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_4bit(cfg: TrainConfig, device: str, dtype: torch.dtype):
    """QLoRA's base: NF4 weights with double quantisation, computing in ``dtype`` (the
    built-in model is saved once to ``output_dir/base`` and loaded from there)."""
    import dataclasses

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    plain = dataclasses.replace(cfg, load_in_4bit=False)
    if cfg.model is None:
        model, tokenizer, name = _load_model(plain, "cpu", dtype)
        source = os.path.join(cfg.output_dir, "base")
        model.save_pretrained(source)
        tokenizer.save_pretrained(source)
        del model
    else:
        source, name = cfg.model, cfg.model
        tokenizer = _load_tokenizer(plain)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
    )
    kwargs = {"attn_implementation": cfg.attn_implementation or "sdpa"}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype,
            quantization_config=quantization,
            device_map={"": device},
            local_files_only=True,
            **kwargs,
        )
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(
            f"{cfg.name('load_in_4bit')}=true: {source!r} could not be loaded in 4 bits ({' '.join(str(exc).split())})"
        ) from None
    return model, _with_template(cfg, tokenizer), f"{name} (4-bit NF4 base)"


def _with_template(cfg: TrainConfig, tokenizer):
    """The tokenizer with the chat template ``chat_template`` names (its own by default)."""
    from offloadkit.data.sft import CHATML_TEMPLATE

    if cfg.chat_template == "chatml":
        tokenizer.chat_template = CHATML_TEMPLATE
    elif cfg.chat_template and "{" in cfg.chat_template:
        tokenizer.chat_template = cfg.chat_template
    return tokenizer


def _training_data(cfg: TrainConfig, tokenizer):
    """The training dataset, its collator (None: fixed-length blocks) and notes."""
    from offloadkit.data import TokenBlocks, load_texts
    from offloadkit.data.sft import SFTExamples, build_examples, pad_collate

    if not cfg.datasets:
        try:
            return TokenBlocks(tokenizer, load_texts(cfg.dataset, cfg.text_field), cfg.seq_len), None, []
        except ValueError as exc:
            hint = f"; use a smaller {cfg.name('seq_len')} or more text" if "fewer than one block" in str(exc) else ""
            raise ConfigError(f"{cfg.name('dataset')}: {exc}{hint}") from None
    examples, notes = [], []
    for spec in cfg.dataset_specs():
        try:
            got, dropped = build_examples(spec, tokenizer, cfg.seq_len, cfg.train_on_inputs)
        except ValueError as exc:
            raise ConfigError(f"{cfg.name('datasets')}: {exc}") from None
        examples += got
        if dropped:
            notes.append(f"{spec.path}: {dropped} examples longer than {cfg.name('seq_len')}={cfg.seq_len} dropped")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return SFTExamples(examples), pad_collate(pad), notes


def _training_args(cfg: TrainConfig, cuda: bool, **overrides):
    from transformers import TrainingArguments

    from offloadkit.integrations.hf_args import checkpointing_requested, set_checkpointing

    reporters = [cfg.report_to] if isinstance(cfg.report_to, str) else list(cfg.report_to)
    reporters = [r for r in reporters if r != "none"]
    kwargs = dict(
        output_dir=cfg.output_dir,
        per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        max_steps=cfg.max_steps or -1,
        num_train_epochs=cfg.num_epochs or 1.0,
        learning_rate=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        lr_scheduler_type=cfg.lr_scheduler,
        optim=cfg.optimizer,
        logging_steps=cfg.logging_steps,
        save_strategy="steps" if cfg.save_steps else "no",
        save_steps=cfg.save_steps or 500,
        save_total_limit=cfg.save_total_limit,
        report_to=reporters or "none",
        disable_tqdm=True,
        seed=cfg.seed,
        remove_unused_columns=False,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        fp16=cfg.dtype == "float16",
        logging_nan_inf_filter=False,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
    )
    kwargs.update(overrides)
    args = TrainingArguments(**kwargs)  # type: ignore[arg-type]  # values checked by TrainConfig
    if cfg.gradient_checkpointing_kwargs:
        set_checkpointing(args, checkpointing_requested(args), cfg.gradient_checkpointing_kwargs)
    return args


def _quiet(trainer):
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    return trainer


def _steps_planned(cfg: TrainConfig, blocks: int) -> int:
    if cfg.max_steps:
        return cfg.max_steps
    per_epoch = max(1, math.ceil(blocks / cfg.batch_size) // cfg.gradient_accumulation_steps)
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
    model.save_pretrained(os.path.join(cfg.output_dir, name))  # offloading is detached by now
    tokenizer.save_pretrained(os.path.join(cfg.output_dir, name))
    save_dir = os.path.join(final, name)
    if cfg.lora_rank:
        return save_dir, f"peft.AutoPeftModelForCausalLM.from_pretrained({save_dir!r})"
    return save_dir, f"transformers.AutoModelForCausalLM.from_pretrained({save_dir!r})"


def run_train(cfg: TrainConfig, log=print) -> dict:
    """Fine-tune as ``cfg`` says; returns the report (also written to ``output_dir``).

    Raises:
        ConfigError: a setting that cannot work, found before the first step.
        TrainingInterrupted: Ctrl-C during training.
        TrainingFailedError: a NaN or infinite training loss (nothing is saved).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the network
    from offloadkit.cli.distributed import Ranks
    from offloadkit.cli.preflight import incomplete_run, preflight, replaces_earlier_run

    wall = time.perf_counter()
    cuda = torch.cuda.is_available()
    cfg = cfg.resolved(cuda)
    preflight(cfg)
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


def _run(cfg: TrainConfig, final: str, ranks, cuda: bool, wall: float, log) -> dict:
    """:func:`run_train` after the checks: train in ``cfg.output_dir``, and end in ``final``."""
    from transformers import Trainer

    from offloadkit.cli.compare import measure_in_own_process, measure_without_offloadkit, saving
    from offloadkit.cli.distributed import barrier, gather, rank_figures
    from offloadkit.cli.measure import RunMeasure, StepProbe
    from offloadkit.cli.plot import plot_timelines
    from offloadkit.cli.report import ProgressBar, build_report, offload_probes, write_report
    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    if not ranks.main:
        log = _silent  # rank 0 speaks for the run
    device = ranks.device(cuda)
    if cuda:
        torch.cuda.set_device(device)
    dtype = load_dtype(cfg, cuda)
    torch.manual_seed(cfg.seed)
    model, tokenizer, name = _load_model(cfg, device, dtype)
    base_dir = None
    if cfg.lora_rank:
        from offloadkit.integrations.peft_utils import apply_lora

        if cfg.model is None:
            # The built-in base exists only in this process: save it so the adapter can be used later.
            base_dir = os.path.join(cfg.output_dir, "base")
            if ranks.main and not cfg.load_in_4bit:  # a 4-bit base was saved there before quantising
                model.save_pretrained(base_dir)
                tokenizer.save_pretrained(base_dir)
        model = apply_lora(
            model,
            rank=cfg.lora_rank,
            alpha=cfg.lora_alpha,
            target_modules=cfg.lora_target_modules,
            dropout=cfg.lora_dropout,
            modules_to_save=cfg.lora_modules_to_save,
            use_dora=cfg.lora_use_dora,
        )
        if base_dir is not None:
            _name_base(model, os.path.join(final, "base"))
    dataset, collator, data_notes = _training_data(cfg, tokenizer)
    notes = [f"Axolotl keys without effect here: {', '.join(cfg._ignored)}"] if cfg._ignored else []
    notes += data_notes
    planned = _steps_planned(cfg, len(dataset))
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
    if len(dataset) < sequences_per_step:
        # A step cannot be filled: each step trains the whole (small) dataset once.
        notes.append(
            f"the dataset has {len(dataset)} sequences of {cfg.seq_len} tokens, fewer than the {sequences_per_step} "
            f"a step asks for (batch_size x gradient_accumulation_steps x processes): each step trains "
            f"{len(dataset)}; give more text or lower batch_size"
        )
        sequences_per_step = len(dataset)
    tokens_per_step = sequences_per_step * cfg.seq_len

    class OffloadTrainer(ActivationOffloadingMixin, Trainer):
        pass

    trainer = _quiet(
        OffloadTrainer(
            model=model,
            args=_training_args(cfg, cuda),
            train_dataset=dataset,
            data_collator=collator,
            offload_config=cfg.offload,
        )
    )
    with_ = RunMeasure("with offloadkit")
    probe = StepProbe(with_, profile_step, extra=offload_probes(trainer))
    progress = ProgressBar(tokens_per_step, with_.step_times, show=ranks.main)
    stop = _StopAtStepEnd(lambda message: ranks.main and print(message, file=sys.stderr, flush=True))
    guard = _LossGuard()
    trainer.add_callback(probe)
    trainer.add_callback(progress)
    trainer.add_callback(stop.callback())
    trainer.add_callback(guard.callback())
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

    report = build_report(
        trainer, progress.losses, with_, elapsed, tokens_per_step, _describe(cfg, name, dtype, cuda, sequences_per_step)
    )
    report["profile_step"] = profile_step
    report["resumed_from"] = resumed
    report["offload_summary"] = _effective_summary(cfg, report)
    report["notes"] = notes + report["notes"]
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
    # The plain run builds its own optimizer: this one's state must not count against it.
    trainer.accelerator.free_memory()
    trainer.optimizer = trainer.lr_scheduler = None
    del trainer

    def plain_trainer(max_steps, callbacks):
        args = _training_args(
            cfg, cuda, max_steps=max_steps, save_strategy="no", report_to="none", logging_strategy="no"
        )
        return _quiet(
            Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=callbacks)
        )

    if ranks.distributed:
        # A rank that runs out of memory alone would leave the others waiting in a collective.
        without = RunMeasure(
            "without offloadkit", status="skipped", note=f"a {ranks.world}-process run; run one process to compare"
        )
    elif report["offload_summary"].startswith("nothing"):
        without = RunMeasure(
            "without offloadkit",
            status="skipped",
            note="no memory option acted on this run, so it is the run without offloadkit",
        )
    elif cfg.compare and len(with_.step_times) > profile_step:
        print(
            f"offloadkit: measuring steps 0-{profile_step} again without offloadkit, for comparison (Ctrl-C skips it)",
            file=sys.stderr,
        )
        try:
            if cuda:
                without = measure_without_offloadkit(plain_trainer, model, profile_step, tokens_per_step)
            else:
                # RSS never falls: the plain run gets a fresh process, as the real run had.
                without = measure_in_own_process(cfg, profile_step, tokens_per_step)
        except KeyboardInterrupt:
            # The run itself is finished and saved: keep its report and plot.
            without = RunMeasure("without offloadkit", status="skipped", note="interrupted (Ctrl-C)")
    else:
        without = RunMeasure(
            "without offloadkit",
            status="skipped",
            note="compare: false" if not cfg.compare else "the run was shorter than the profiled step",
        )
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
    if not ranks.main:
        barrier()  # rank 0 writes the output directory
        return report
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
    barrier()
    return report
