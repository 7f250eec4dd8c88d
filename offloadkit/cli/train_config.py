"""Settings of ``offloadkit train``: one typed dataclass, read from flat YAML/JSON (offloadkit's
keys, or an Axolotl config) with one-line errors naming the key, the value and the fix.

Checks here are pure (types, ranges, combinations); what depends on the machine (paths,
installed packages) is checked by :mod:`offloadkit.cli.preflight` before the model loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from offloadkit.config import ConfigError, ConfigProblemsError, OffloadConfig, check_keys, load_mapping

__all__ = ["TrainConfig", "default_offload", "DEFAULT_STEPS"]

DEFAULT_STEPS = 100
_FLOATS = ("learning_rate", "lora_dropout", "num_epochs", "weight_decay", "max_grad_norm")
_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)


def default_offload(cuda: bool) -> dict:
    """The built-in default: everything that helps on this machine, nothing that cannot work."""
    if cuda:
        return {"gradient_checkpointing": True, "activation_offloading": True}
    # On a CPU-only machine the activations are CPU memory: moving them to disk saves RAM.
    return {"gradient_checkpointing": True, "activation_offloading": "disk"}


@dataclass
class TrainConfig:
    """Settings of ``offloadkit train`` (besides the offloading keys).

    Attributes:
        model: local Hugging Face model directory; None builds ``model_shape`` from a config.
        tokenizer: local tokenizer directory (default: the model directory).
        model_shape: built-in Llama shape: tiny, small, llama-3.2-1b, llama-3-8b.
        dataset: local .txt, .jsonl or .json file; None uses the shipped public-domain corpus.
        text_field: the JSON field holding the text.
        datasets: instead of ``dataset``, a list of local datasets with their types
            (:class:`~offloadkit.data.sft.DatasetSpec`'s keys: completion, alpaca with the
            loss on the response, chat_template with the loss on the assistant's turns).
        train_on_inputs: alpaca and chat_template: train on the prompt too.
        chat_template: chat_template datasets: "tokenizer_default" (the tokenizer's own),
            "chatml", or a Jinja template.
        attn_implementation: the model's attention kernel ("sdpa", "flash_attention_2",
            "eager", ...); one that is not installed falls back to sdpa with a warning.
        output_dir: where the model/adapter, checkpoints, report and plot go.
        seq_len, batch_size: tokens per sequence and sequences per step (None: 256 x 4 on
            a CPU, 1024 x 16 on a GPU).
        max_steps: optimizer steps (None: ``num_epochs`` when given, else 100).
        num_epochs: passes over the dataset when ``max_steps`` is not given.
        learning_rate, lr_scheduler, warmup_steps, optimizer, gradient_accumulation_steps,
        logging_steps, seed, weight_decay, max_grad_norm: as in Hugging Face
        ``TrainingArguments`` (``max_grad_norm: 0``: no clipping).
        save_steps, save_total_limit: Trainer checkpoints every N steps, keeping the last K
            (Ctrl-C saves one too, of the step it stops at).
        resume_from_checkpoint: a checkpoint directory, or true for the newest in output_dir.
        overwrite_output_dir: replace an earlier run found in output_dir (its report, model
            or adapter, and checkpoints) once this run has saved: it trains in
            ``output_dir/incomplete-run`` meanwhile, so a crash or Ctrl-C leaves the earlier run
            as it was; without it such a directory is refused.
        report_to: "none", or a logger the Trainer supports (tensorboard, wandb, ...).
        lora_rank: LoRA rank (0: full fine-tune); lora_alpha (default 2 x rank),
            lora_dropout, lora_target_modules ("all-linear", a list of module names, or a
            regular expression matched against whole module names, as PEFT takes it);
            lora_modules_to_save (modules trained whole, e.g. [lm_head, embed_tokens]) and
            lora_use_dora (DoRA adapters) as PEFT takes them.
        dtype: auto (bf16 on GPU, fp32 on CPU), bfloat16, float16 (mixed precision: fp32
            weights, fp16 autocast, loss scaling) or float32.
        load_in_4bit: QLoRA: load the base in 4 bits (NF4 with double quantisation,
            bitsandbytes), computing in ``dtype``; needs LoRA (``lora_rank`` > 0).
        gradient_checkpointing_kwargs: passed to the Trainer's checkpointing (use_reentrant).
        profile_step: the step whose memory is measured and plotted.
        compare: also run the first steps without offloadkit and show both.
        offload: the offloading configuration.
    """

    model: str | None = None
    tokenizer: str | None = None
    model_shape: str = "small"
    dataset: str | None = None
    text_field: str = "text"
    datasets: list | None = None
    train_on_inputs: bool = False
    chat_template: str | None = None
    attn_implementation: str | None = None
    output_dir: str = "offloadkit-output"
    seq_len: int | None = None
    batch_size: int | None = None
    gradient_accumulation_steps: int = 1
    max_steps: int | None = None
    num_epochs: float | None = None
    learning_rate: float = 3e-3
    lr_scheduler: str = "cosine"
    warmup_steps: int = 5
    optimizer: str = "adamw_torch"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    logging_steps: int = 1
    save_steps: int | None = None
    save_total_limit: int | None = None
    resume_from_checkpoint: str | bool | None = None
    overwrite_output_dir: bool = False
    report_to: str | list = "none"
    lora_rank: int | None = 0
    lora_alpha: int | None = None
    lora_dropout: float = 0.0
    lora_target_modules: str | list = "all-linear"
    lora_modules_to_save: list | None = None
    lora_use_dora: bool = False
    dtype: str = "auto"
    load_in_4bit: bool = False
    seed: int = 0
    gradient_checkpointing_kwargs: dict | None = None
    profile_step: int = 2
    compare: bool = True
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    _names: dict = field(default_factory=dict, repr=False, compare=False)  # key -> as written by the user
    _ignored: list = field(default_factory=list, repr=False, compare=False)  # Axolotl keys without effect

    @classmethod
    def train_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "offload" and not f.name.startswith("_")]

    @classmethod
    def from_dict(cls, data: dict, source: str = "config", cuda: bool | None = None) -> "TrainConfig":
        """Build and validate; Axolotl configs are recognised by their keys and mapped."""
        from offloadkit.integrations import axolotl

        names: dict = {}
        ignored: list = []
        if axolotl.looks_like_axolotl(data):
            data, names, ignored = axolotl.to_train_dict(data, cls.train_keys() + OffloadConfig.keys(), source)
        data = check_keys(dict(data), cls.train_keys() + OffloadConfig.keys(), source)
        train = {k: v for k, v in data.items() if k in cls.train_keys()}
        # seq_len and batch_size are keys of both: the run owns them (validated under the user's
        # names) and resolved() hands them to the planner.
        offload = {k: v for k, v in data.items() if k in OffloadConfig.keys() and k not in train}
        # The user's keys go over the built-in defaults key by key: writing disk_dir alone
        # does not switch checkpointing and offloading off. The default offloading is
        # checkpoint-input offload; with checkpointing turned off it would offload every
        # activation (several times slower), so it is then only on when asked for.
        defaults = default_offload(_cuda() if cuda is None else cuda)
        if offload.get("gradient_checkpointing") is False:
            defaults.pop("activation_offloading", None)
        offload = {**defaults, **offload}
        for key in _FLOATS:
            if isinstance(train.get(key), str):
                train[key] = _float(train[key], names.get(key, key), source)
        config = cls(**train, offload=OffloadConfig.from_dict(offload, source=source), _names=names, _ignored=ignored)
        config.validate(source)
        config.warn_without_effect()
        return config

    @classmethod
    def from_file(cls, path: str | None) -> "TrainConfig":
        return cls.from_dict(load_mapping(path) if path else {}, source=path or "built-in defaults")

    def name(self, key: str) -> str:
        """The key as the user wrote it (an Axolotl name, when the config was one)."""
        return self._names.get(key, key)

    def resolved(self, cuda: bool) -> "TrainConfig":
        """A copy with the device-dependent defaults filled in."""
        seq_len, batch_size = self.seq_len or (1024 if cuda else 256), self.batch_size or (16 if cuda else 4)
        return dataclasses.replace(
            self,
            seq_len=seq_len,
            batch_size=batch_size,
            max_steps=self.max_steps if self.max_steps or self.num_epochs else DEFAULT_STEPS,
            offload=dataclasses.replace(self.offload, seq_len=seq_len, batch_size=batch_size),
        )

    def warn_without_effect(self) -> None:
        """One warning per setting that cannot take effect (called once, when the config is read)."""
        if self.offload.layer_offloading and not self.lora_rank and self.model is None:
            if not self.offload.optimizer_offloading:
                self.offload._warn(
                    f"layer_offloading streams frozen weights, and a full fine-tune's "
                    f"({self.name('lora_rank')}: 0) only with optimizer_offloading: true (updates in backward); "
                    "without it there is nothing to stream, so it has no effect"
                )
        lora_keys = [k for k in ("lora_alpha",) if getattr(self, k) is not None]
        lora_keys += [k for k in ("lora_dropout",) if getattr(self, k)]
        lora_keys += [k for k in ("lora_target_modules",) if getattr(self, k) != "all-linear"]
        lora_keys += [k for k in ("lora_modules_to_save", "lora_use_dora") if getattr(self, k)]
        if lora_keys and not self.lora_rank:
            self.offload._warn(
                f"{', '.join(self.name(k) for k in lora_keys)} only apply with LoRA "
                f"({self.name('lora_rank')} > 0); they have no effect"
            )

    def dataset_specs(self) -> list:
        """The datasets as :class:`~offloadkit.data.sft.DatasetSpec` (``dataset`` is one
        completion dataset; None: the shipped corpus)."""
        from offloadkit.data.sft import DatasetSpec

        if self.datasets:
            return [DatasetSpec(**entry) for entry in self.datasets]
        if self.dataset is None:
            return []
        return [DatasetSpec(path=self.dataset, type="completion", field=self.text_field)]

    def validate(self, source: str = "config") -> None:
        """Check every setting; all problems are reported together.

        Raises:
            ConfigProblemsError: one or more settings that cannot work.
        """
        problems: list[tuple[str, bool]] = []

        def fail(key, value, fix):
            problems.append((f"{self.name(key)}={value!r} {fix}", False))

        self._check(fail)
        if problems:
            raise ConfigProblemsError(source, problems)

    def _check(self, fail) -> None:
        from offloadkit.data.sft import SFT_TYPES, DatasetSpec
        from offloadkit.models.zoo import LLAMA_SHAPES

        ints: dict[str, int] = {
            "gradient_accumulation_steps": 1,
            "warmup_steps": 0,
            "logging_steps": 1,
            "seed": 0,
            "profile_step": 0,
            "seq_len": 2,
            "batch_size": 1,
            "max_steps": 1,
            "save_steps": 1,
            "save_total_limit": 1,
            "lora_rank": 0,
            "lora_alpha": 1,
        }
        for key, low in ints.items():
            value = getattr(self, key)
            if value is None and key in (
                "seq_len",
                "batch_size",
                "max_steps",
                "save_steps",
                "save_total_limit",
                "lora_rank",
                "lora_alpha",
            ):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                fail(key, value, f"must be an integer >= {low}")
        for key, floor, example in (
            ("learning_rate", 0.0, "2e-4"),
            ("num_epochs", 0.0, "3"),
        ):
            value = getattr(self, key)
            if value is None and key == "num_epochs":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= floor:
                fail(key, value, f"must be a positive number, e.g. {example}")
        norm = self.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float)) or norm < 0):
            fail("max_grad_norm", norm, "must be a number >= 0, e.g. 1.0 (0: no clipping)")
        if (
            isinstance(self.lora_dropout, bool)
            or not isinstance(self.lora_dropout, (int, float))
            or not 0 <= self.lora_dropout < 1
        ):
            fail("lora_dropout", self.lora_dropout, "must be a number in [0, 1)")
        if (
            isinstance(self.weight_decay, bool)
            or not isinstance(self.weight_decay, (int, float))
            or self.weight_decay < 0
        ):
            fail("weight_decay", self.weight_decay, "must be a number >= 0, e.g. 0.01")
        if self.datasets is not None:
            if self.dataset is not None:
                fail("datasets", self.datasets, f"and {self.name('dataset')} both name data; keep one")
            elif not isinstance(self.datasets, list) or not self.datasets:
                fail(
                    "datasets", self.datasets, "must be a list of entries like [{path: data/train.jsonl, type: alpaca}]"
                )
            else:
                for i, entry in enumerate(self.datasets):
                    try:
                        spec = DatasetSpec(**entry) if isinstance(entry, dict) else None
                    except TypeError as exc:
                        spec = None
                        why = str(exc).split("got ")[-1]
                        fail("datasets", entry, f"(entry {i}) has a key DatasetSpec does not take ({why})")
                        continue
                    if spec is None or spec.type not in SFT_TYPES or not isinstance(spec.path, str):
                        fail("datasets", entry, f"(entry {i}) must have a path and a type of {', '.join(SFT_TYPES)}")
        if not isinstance(self.train_on_inputs, bool):
            fail("train_on_inputs", self.train_on_inputs, "must be true or false")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            fail("chat_template", self.chat_template, "must be tokenizer_default, chatml or a Jinja template")
        if self.attn_implementation is not None and not isinstance(self.attn_implementation, str):
            fail("attn_implementation", self.attn_implementation, "must be a name like sdpa or flash_attention_2")
        for key in ("model", "tokenizer", "dataset", "output_dir"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                what = (
                    "one file path (.txt, .jsonl or .json); join several files into one"
                    if key == "dataset"
                    else "a path (a string)"
                )
                fail(key, value, f"must be {what}")
        if not self.output_dir:
            fail("output_dir", self.output_dir, "must name a directory")
        if not isinstance(self.text_field, str) or not self.text_field:
            fail("text_field", self.text_field, "must be the name of a JSON field, e.g. text")
        if self.lr_scheduler not in _SCHEDULERS:
            fail("lr_scheduler", self.lr_scheduler, f"is not a scheduler; use one of {', '.join(_SCHEDULERS)}")
        if not isinstance(self.optimizer, str):
            fail("optimizer", self.optimizer, "must be an optimizer name, e.g. adamw_torch")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            fail("dtype", self.dtype, "must be auto, bfloat16, float16 or float32")
        if not (
            (isinstance(self.lora_target_modules, str) and self.lora_target_modules)
            or (
                isinstance(self.lora_target_modules, list)
                and self.lora_target_modules
                and all(isinstance(m, str) for m in self.lora_target_modules)
            )
        ):
            fail(
                "lora_target_modules",
                self.lora_target_modules,
                'must be "all-linear", a list like [q_proj, v_proj], or a regular expression of module names',
            )
        if self.gradient_checkpointing_kwargs is not None:
            kwargs = self.gradient_checkpointing_kwargs
            if not isinstance(kwargs, dict) or not set(kwargs) <= {"use_reentrant", "preserve_rng_state"}:
                fail(
                    "gradient_checkpointing_kwargs",
                    kwargs,
                    "takes a mapping with use_reentrant (and preserve_rng_state), e.g. {use_reentrant: false}",
                )
        if not isinstance(self.resume_from_checkpoint, (str, bool, type(None))):
            fail("resume_from_checkpoint", self.resume_from_checkpoint, "must be a checkpoint directory or true")
        if self.load_in_4bit and not self.lora_rank:
            fail(
                "load_in_4bit",
                self.load_in_4bit,
                f"needs LoRA adapters ({self.name('lora_rank')} > 0): a 4-bit base cannot be fully fine-tuned",
            )
        if self.lora_modules_to_save is not None and not (
            isinstance(self.lora_modules_to_save, list) and all(isinstance(m, str) for m in self.lora_modules_to_save)
        ):
            fail("lora_modules_to_save", self.lora_modules_to_save, "must be a list of module names, e.g. [lm_head]")
        for key in ("compare", "overwrite_output_dir", "load_in_4bit", "lora_use_dora"):
            if not isinstance(getattr(self, key), bool):
                fail(key, getattr(self, key), "must be true or false")
        reporters = [self.report_to] if isinstance(self.report_to, str) else self.report_to
        if not isinstance(reporters, list) or not all(isinstance(r, str) for r in reporters):
            fail("report_to", self.report_to, "must be none, tensorboard, or a list of logger names")
        if self.model is None and self.model_shape not in LLAMA_SHAPES:
            fail("model_shape", self.model_shape, f"is unknown; use one of {sorted(LLAMA_SHAPES)}")


def _float(value: str, key: str, source: str) -> float:
    # PyYAML reads 2e-4 (no dot) as a string; accept what the user obviously meant.
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{source}: {key}={value!r} is not a number; write it like 2e-4 or 0.0002") from None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
