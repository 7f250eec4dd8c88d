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
_FLOATS = (
    "learning_rate",
    "lora_dropout",
    "num_epochs",
    "weight_decay",
    "max_grad_norm",
    "warmup_ratio",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "neftune_noise_alpha",
    "val_set_size",
    "cosine_min_lr_ratio",
    "loss_watchdog_threshold",
    "rl_beta",
    "kto_desirable_weight",
    "kto_undesirable_weight",
    "center_rewards_coefficient",
)
# Optimizers without Adam's betas and epsilon (the Trainer would leave adam_* unused).
_NOT_ADAM = ("sgd", "adafactor", "adagrad", "rmsprop", "lomo", "adalomo", "muon")
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
        ``TrainingArguments`` (``max_grad_norm: 0``: no clipping; ``warmup_steps`` below 1:
        that fraction of the steps, rounded up).
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
        warmup_ratio: warmup as a fraction of the run's steps, instead of ``warmup_steps``.
        adam_beta1, adam_beta2, adam_epsilon: the Adam-family optimizer's betas and epsilon
            (None: the Trainer's 0.9, 0.999, 1e-8).
        neftune_noise_alpha: NEFTune: uniform noise of this scale on the input embeddings
            while training (the Trainer's ``neftune_noise_alpha``).
        cosine_min_lr_ratio: cosine schedule down to this fraction of the learning rate
            (the Trainer's cosine_with_min_lr).
        val_set_size: held out for evaluation: a fraction of the examples (< 1) or a count.
        eval_steps, evals_per_epoch: evaluate every N steps, or N times per epoch (steps per
            epoch from the dataset); with a held-out set and neither, once per epoch.
        eval_batch_size: sequences per evaluation batch (default ``batch_size``).
        saves_per_epoch: checkpoints N times per epoch, instead of ``save_steps``.
        save_only_model: checkpoints hold the weights only (no optimizer state).
        sample_packing: several examples per row of ``seq_len`` tokens, each attending only
            to itself (position ids restart per example; refused for a model whose attention
            does not keep them apart); eval_sample_packing: the same for the held-out set
            (default: as sample_packing); sample_packing_sequentially: rows filled in the
            examples' order (a new row when the next does not fit) instead of longest first.
        dataloader_drop_last: leave out an epoch's last batch when it is not full (Axolotl
            sets it with sample_packing and eval_sample_packing: false).
        pad_to_sequence_len: pad every batch to ``seq_len`` tokens.
        min_sample_len: drop examples shorter than this many tokens.
        dataset_exact_deduplication: drop repeated examples (identical tokens and labels).
        shuffle_merged_datasets: shuffle the examples before the held-out split.
        group_by_length: batches of examples of similar length; curriculum_sampling: the
            examples in dataset order (no shuffling).
        loss_watchdog_threshold, loss_watchdog_patience: stop when the training loss stays
            above the threshold for that many logged steps (default 3).
        trust_remote_code: let the model and tokenizer run their own code from their
            directory (as ``from_pretrained(trust_remote_code=True)``).
        reinit_weights: train the model's architecture from random weights (its config only,
            ``from_config`` after ``seed``), as a pretraining run from scratch does.
        model_revision: the hub revision (branch, tag or commit) of a hub id ``model``.
        model_class: the transformers class the model loads with (default
            AutoModelForCausalLM); model_config: overrides of the model's config.json.
        model_quantization_config, model_quantization_config_kwargs: a transformers
            quantization config class and its arguments (Mxfp4Config with dequantize).
        tokenizer_type, tokenizer_use_fast, tokenizer_legacy: how the tokenizer loads (its
            class, fast or slow, Llama's legacy flag).
        special_tokens: the tokenizer's special tokens (bos, eos, pad, unk, ...), added when
            new; tokens: new tokens to add; the embeddings grow to the tokenizer's length
            (to a multiple of 32 with resize_token_embeddings_to_32x).
        eot_tokens: the chat template's end-of-turn tokens (each must be one token of the
            tokenizer); trained as the end of each trained turn.
        lora_model_dir: an adapter saved by PEFT, loaded and trained further (its own rank,
            alpha and targets).
        lora_use_rslora: rank-stabilised LoRA (scaling alpha / sqrt(rank)).
        lora_fan_in_fan_out: LoRA over layers that store their weight transposed (GPT-2's
            Conv1D); lora_target_parameters: LoRA on parameters by name (MoE experts).
        unfrozen_parameters: a full fine-tune of only the parameters matching these
            patterns (matched from the start of the name; a dot is a dot).
        load_in_8bit: load the base in 8 bits (bitsandbytes LLM.int8), with LoRA.
        quantization_kwargs: more arguments of the 4- or 8-bit BitsAndBytesConfig.
        quantize_moe_experts: with a 4- or 8-bit base, MoE expert weights stored as 3-D
            parameters are quantized too (NF4, or int8 rows).
        tf32: TF32 matmuls on a GPU that has them (None: PyTorch's default).
        auto_resume_from_checkpoints: continue from the newest checkpoint in output_dir
            when there is one (else start).
        rl: "dpo": Direct Preference Optimization (TRL's DPO trainer) on preference pairs
            (``datasets`` of type chat_template with ``field_chosen`` and ``field_rejected``),
            the reference policy being the model as loaded (kept frozen);
            rl_beta: DPO's beta (default 0.1), how far the policy may move from the reference.
            "kto": Kahneman-Tversky Optimization (TRL's KTO trainer) on single completions
            labelled desirable or not (``datasets`` of type kto), with rl_beta and
            kto_desirable_weight, kto_undesirable_weight (the loss's weights of the two kinds).
        lisa_n_layers, lisa_step_interval, lisa_layers_attribute: LISA layer sampling (a full
            fine-tune): every ``lisa_step_interval`` steps (and at step 1) only ``lisa_n_layers``
            decoder layers, drawn at random, train; the embeddings and the head always train;
            ``lisa_layers_attribute``: where the layers are (default ``model.layers``).
        qat: quantization-aware training (:mod:`offloadkit.cli.qat`): every linear layer
            fake-quantized as Axolotl's ``qat:`` says (weight_dtype int4 with activation_dtype
            int8 or none, group_size; or mxfp4), fake_quant_after_n_steps; a full fine-tune.
        lr_quadratic_warmup: with the cosine schedule, the warmup's factor squared ((step /
            warmup)**2), as Axolotl's cosine schedule with quadratic warmup.
        early_stopping_patience: stop once the evaluation loss has not improved for that many
            evaluations in a row (the Trainer's EarlyStoppingCallback), and end with the best
            checkpoint's weights; needs a held-out set and save_steps a multiple of eval_steps,
            as Axolotl requires.
        reward_model: a Bradley-Terry reward model (TRL's reward trainer): ``model_class:
            AutoModelForSequenceClassification`` with ``num_labels: 1`` (one score), trained to
            score each pair's chosen conversation above its rejected one (``datasets`` of type
            bradley_terry); center_rewards_coefficient: TRL's penalty on the square of the pair's
            summed scores (rewards centred on 0).
        drop_unsupported_keys: train an Axolotl config without the keys offloadkit cannot
            honour (listed in one warning and in the report) instead of refusing it.
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
    warmup_steps: int | float = 5
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
    warmup_ratio: float | None = None
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    adam_epsilon: float | None = None
    neftune_noise_alpha: float | None = None
    cosine_min_lr_ratio: float | None = None
    val_set_size: float = 0
    eval_steps: int | None = None
    evals_per_epoch: int | None = None
    eval_batch_size: int | None = None
    saves_per_epoch: int | None = None
    save_only_model: bool = False
    sample_packing: bool = False
    sample_packing_sequentially: bool = False
    eval_sample_packing: bool | None = None
    dataloader_drop_last: bool = False
    pad_to_sequence_len: bool = False
    min_sample_len: int | None = None
    dataset_exact_deduplication: bool = False
    shuffle_merged_datasets: bool = True
    group_by_length: bool = False
    curriculum_sampling: bool = False
    loss_watchdog_threshold: float | None = None
    loss_watchdog_patience: int | None = None
    trust_remote_code: bool = False
    reinit_weights: bool = False
    model_revision: str | None = None
    model_class: str | None = None
    model_config: dict | None = None
    model_quantization_config: str | None = None
    model_quantization_config_kwargs: dict | None = None
    tokenizer_type: str | None = None
    tokenizer_use_fast: bool | None = None
    tokenizer_legacy: bool | None = None
    special_tokens: dict | None = None
    tokens: list | None = None
    eot_tokens: list | None = None
    resize_token_embeddings_to_32x: bool = False
    lora_model_dir: str | None = None
    lora_use_rslora: bool = False
    lora_fan_in_fan_out: bool = False
    lora_target_parameters: list | None = None
    unfrozen_parameters: list | None = None
    load_in_8bit: bool = False
    quantization_kwargs: dict | None = None
    quantize_moe_experts: bool = False
    tf32: bool | None = None
    auto_resume_from_checkpoints: bool = False
    rl: str | None = None
    rl_beta: float | None = None
    kto_desirable_weight: float | None = None
    kto_undesirable_weight: float | None = None
    early_stopping_patience: int | None = None
    lr_quadratic_warmup: bool = False
    qat: dict | None = None
    lisa_n_layers: int | None = None
    lisa_step_interval: int | None = None
    lisa_layers_attribute: str = "model.layers"
    reward_model: bool = False
    num_labels: int | None = None
    center_rewards_coefficient: float | None = None
    drop_unsupported_keys: bool = False
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    _names: dict = field(default_factory=dict, repr=False, compare=False)  # key -> as written by the user
    _ignored: list = field(default_factory=list, repr=False, compare=False)  # Axolotl keys without effect
    _dropped: list = field(default_factory=list, repr=False, compare=False)  # not honoured, dropped on request

    @classmethod
    def train_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "offload" and not f.name.startswith("_")]

    @classmethod
    def from_dict(
        cls, data: dict, source: str = "config", cuda: bool | None = None, drop_unsupported_keys: bool = False
    ) -> "TrainConfig":
        """Build and validate; Axolotl configs are recognised by their keys and mapped.

        Args:
            drop_unsupported_keys: as the key of that name (``--drop-unsupported-keys``).
        """
        from offloadkit.integrations import axolotl

        names: dict = {}
        ignored: list = []
        dropped: list = []
        if drop_unsupported_keys:
            data = dict(data, drop_unsupported_keys=True)
        if axolotl.looks_like_axolotl(data):
            data, names, ignored, dropped = axolotl.to_train_dict(data, cls.train_keys() + OffloadConfig.keys(), source)
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
        if train.get("warmup_ratio") is not None:
            if "warmup_steps" in train:
                raise ConfigError(
                    f"{source}: {names.get('warmup_ratio', 'warmup_ratio')} and "
                    f"{names.get('warmup_steps', 'warmup_steps')} both set the warmup; keep one"
                )
            train["warmup_steps"] = 0
        config = cls(
            **train,
            offload=OffloadConfig.from_dict(offload, source=source),
            _names=names,
            _ignored=ignored,
            _dropped=dropped,
        )
        config.validate(source)
        config.warn_without_effect()
        return config

    @classmethod
    def from_file(cls, path: str | None, drop_unsupported_keys: bool = False) -> "TrainConfig":
        return cls.from_dict(
            load_mapping(path) if path else {},
            source=path or "built-in defaults",
            drop_unsupported_keys=drop_unsupported_keys,
        )

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
        lora_keys += [
            k
            for k in (
                "lora_modules_to_save",
                "lora_use_dora",
                "lora_use_rslora",
                "lora_fan_in_fan_out",
                "lora_target_parameters",
            )
            if getattr(self, k)
        ]
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
        from offloadkit.data.sft import KTO_STYLES, PROMPT_STYLES, SFT_TYPES, DatasetSpec
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
            if key == "warmup_steps" and isinstance(value, float) and 0 < value < 1:
                continue  # a fraction of the run's steps, as the Trainer reads a float below 1
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
                    elif spec.type == "kto" and spec.prompt_style not in KTO_STYLES:
                        fail("datasets", entry, f"(entry {i}) type kto needs prompt_style {' or '.join(KTO_STYLES)}")
                    elif (
                        spec.type != "kto"
                        and spec.prompt_style is not None
                        and (spec.type not in ("alpaca", "jeopardy") or spec.prompt_style not in PROMPT_STYLES)
                    ):
                        fail(
                            "datasets",
                            entry,
                            f"(entry {i}) prompt_style is one of {', '.join(PROMPT_STYLES)}, for the types alpaca "
                            "and jeopardy",
                        )
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
        if (
            self.lora_target_modules == []
            and self.lora_rank
            and not (self.lora_target_parameters or self.lora_model_dir)
        ):
            fail(
                "lora_target_modules",
                self.lora_target_modules,
                "names no module to adapt; set lora_target_linear: true, or list modules (or lora_target_parameters)",
            )
        elif not (
            (isinstance(self.lora_target_modules, str) and self.lora_target_modules)
            or (
                isinstance(self.lora_target_modules, list)
                and (
                    self.lora_target_modules or not self.lora_rank or self.lora_target_parameters or self.lora_model_dir
                )
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
        self._check_axolotl_keys(fail)
        if self.model is None and self.model_shape not in LLAMA_SHAPES:
            fail("model_shape", self.model_shape, f"is unknown; use one of {sorted(LLAMA_SHAPES)}")

    def _check_axolotl_keys(self, fail) -> None:
        """The keys Axolotl configs brought: evaluation, packing, optimizer, tokenizer, LoRA."""
        ranges: dict[str, tuple[float, float, bool, str]] = {
            # key: (low, high, high included, example)
            "warmup_ratio": (0.0, 1.0, False, "0.1"),
            "adam_beta1": (0.0, 1.0, False, "0.9"),
            "adam_beta2": (0.0, 1.0, False, "0.999"),
            "cosine_min_lr_ratio": (0.0, 1.0, True, "0.1"),
        }
        for key, (low, high, closed, example) in ranges.items():
            value = getattr(self, key)
            if value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (low <= value <= high if closed else low <= value < high)
            ):
                fail(key, value, f"must be a number in [{low:g}, {high:g}{']' if closed else ')'}, e.g. {example}")
        for key, example in (("adam_epsilon", "1e-8"), ("neftune_noise_alpha", "5"), ("loss_watchdog_threshold", "5")):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                fail(key, value, f"must be a positive number, e.g. {example}")
        size = self.val_set_size
        if (
            isinstance(size, bool)
            or not isinstance(size, (int, float))
            or size < 0
            or (size >= 1 and size != int(size))
        ):
            fail("val_set_size", size, "must be a fraction in [0, 1) or a whole number of examples, e.g. 0.05")
        for key, low in (
            ("eval_steps", 1),
            ("evals_per_epoch", 0),
            ("eval_batch_size", 1),
            ("saves_per_epoch", 1),
            ("min_sample_len", 0),
            ("loss_watchdog_patience", 1),
        ):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                fail(key, value, f"must be an integer >= {low}")
        for key in (
            "save_only_model",
            "sample_packing",
            "sample_packing_sequentially",
            "dataloader_drop_last",
            "pad_to_sequence_len",
            "dataset_exact_deduplication",
            "shuffle_merged_datasets",
            "group_by_length",
            "curriculum_sampling",
            "trust_remote_code",
            "reinit_weights",
            "resize_token_embeddings_to_32x",
            "lora_use_rslora",
            "lora_fan_in_fan_out",
            "load_in_8bit",
            "quantize_moe_experts",
            "auto_resume_from_checkpoints",
            "drop_unsupported_keys",
        ):
            if not isinstance(getattr(self, key), bool):
                fail(key, getattr(self, key), "must be true or false")
        for key in ("eval_sample_packing", "tokenizer_use_fast", "tokenizer_legacy", "tf32"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), bool):
                fail(key, getattr(self, key), "must be true or false")
        for key in ("model_revision", "model_class", "model_quantization_config", "tokenizer_type", "lora_model_dir"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                fail(key, value, "must be a name (a string)")
        for key in ("model_config", "model_quantization_config_kwargs", "quantization_kwargs"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, dict):
                fail(key, value, "must be a mapping of argument names to values")
        tokens = self.special_tokens
        if tokens is not None and not (
            isinstance(tokens, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in tokens.items())
        ):
            fail("special_tokens", tokens, "must be a mapping like {pad_token: '<|end_of_text|>'}")
        for key, example in (
            ("tokens", "['<|im_start|>']"),
            ("eot_tokens", "['<|im_end|>']"),
            ("lora_target_parameters", "[experts.gate_up_proj]"),
            ("unfrozen_parameters", "['^lm_head.weight$']"),
        ):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, list) and all(isinstance(t, str) and t for t in value)):
                fail(key, value, f"must be a list of strings, e.g. {example}")
        if isinstance(self.unfrozen_parameters, list):
            import re

            for pattern in self.unfrozen_parameters:
                if isinstance(pattern, str) and re.search(r"\[[0-9]*(:[0-9]*)?\]$", pattern):
                    fail(
                        "unfrozen_parameters",
                        pattern,
                        "trains part of a parameter (an index range), which offloadkit does not do; name whole "
                        "parameters",
                    )
        if self.saves_per_epoch is not None and self.save_steps is not None:
            fail(
                "saves_per_epoch", self.saves_per_epoch, f"and {self.name('save_steps')} both set checkpoints; keep one"
            )
        if self.evals_per_epoch is not None and self.eval_steps is not None:
            fail(
                "evals_per_epoch", self.evals_per_epoch, f"and {self.name('eval_steps')} both set evaluation; keep one"
            )
        optimizer = self.optimizer if isinstance(self.optimizer, str) else ""
        if optimizer in _NOT_ADAM or optimizer.startswith(("sgd", "adafactor")):
            for key in ("adam_beta1", "adam_beta2", "adam_epsilon"):
                if getattr(self, key) is not None:
                    fail(
                        key,
                        getattr(self, key),
                        f"applies to Adam-family optimizers, not {self.name('optimizer')}: {optimizer}",
                    )
        if self.cosine_min_lr_ratio is not None and self.lr_scheduler not in ("cosine", "cosine_with_min_lr"):
            fail(
                "cosine_min_lr_ratio",
                self.cosine_min_lr_ratio,
                f"applies to the cosine schedule, not {self.name('lr_scheduler')}: {self.lr_scheduler}",
            )
        if self.load_in_8bit is True and self.load_in_4bit is True:
            fail("load_in_8bit", True, f"and {self.name('load_in_4bit')} both quantize the base; keep one")
        if self.load_in_8bit is True and not self.lora_rank:
            fail(
                "load_in_8bit",
                True,
                f"needs LoRA adapters ({self.name('lora_rank')} > 0): an 8-bit base cannot be fully fine-tuned",
            )
        if self.quantize_moe_experts is True and not (
            (self.load_in_4bit is True or self.load_in_8bit is True) and self.lora_rank
        ):
            fail(
                "quantize_moe_experts",
                True,
                f"quantizes the experts of a 4- or 8-bit LoRA run; set {self.name('load_in_4bit')}: true with LoRA",
            )
        if self.lora_model_dir is not None and not self.lora_rank:
            fail(
                "lora_model_dir",
                self.lora_model_dir,
                f"is an adapter to train further; it needs LoRA ({self.name('lora_rank')} > 0, adapter: lora)",
            )
        if self.model_quantization_config is not None and not (
            self.model_quantization_config == "Mxfp4Config"
            and (self.model_quantization_config_kwargs or {}).get("dequantize") is True
        ):
            fail(
                "model_quantization_config",
                self.model_quantization_config,
                "is a quantized base offloadkit cannot train; it loads Mxfp4Config with dequantize: true "
                "(the weights in dtype), or use load_in_4bit",
            )
        if self.group_by_length is True and self.curriculum_sampling is True:
            fail("group_by_length", True, f"and {self.name('curriculum_sampling')} both order the examples; keep one")
        self._check_rl(fail)
        self._check_reward_model(fail)
        lisa = (self.lisa_n_layers, self.lisa_step_interval)
        if any(v is not None for v in lisa):
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in lisa):
                fail(
                    "lisa_n_layers", self.lisa_n_layers, f"and {self.name('lisa_step_interval')} must be integers >= 1"
                )
            elif self.lora_rank:
                fail("lisa_n_layers", self.lisa_n_layers, "samples the layers of a full fine-tune; drop the adapter")
            if not isinstance(self.lisa_layers_attribute, str) or not self.lisa_layers_attribute:
                fail("lisa_layers_attribute", self.lisa_layers_attribute, "must be a dotted path like model.layers")
        if self.qat is not None:
            from offloadkit.cli.qat import qat_problem

            problem = qat_problem(self.qat)
            if problem:
                fail("qat", self.qat, problem)
            elif self.lora_rank or self.load_in_4bit or self.load_in_8bit:
                fail("qat", self.qat, "trains every weight in full precision: drop the adapter and the 4/8-bit base")
        if not isinstance(self.lr_quadratic_warmup, bool):
            fail("lr_quadratic_warmup", self.lr_quadratic_warmup, "must be true or false")
        elif self.lr_quadratic_warmup and self.lr_scheduler != "cosine":
            fail(
                "lr_quadratic_warmup",
                True,
                f"shapes the cosine schedule's warmup, not {self.name('lr_scheduler')}: {self.lr_scheduler}",
            )
        if self.reinit_weights is True and (self.load_in_4bit or self.load_in_8bit or self.model is None):
            fail(
                "reinit_weights",
                True,
                "builds the named model's architecture from random weights: it needs a model (not the built-in one), "
                "and cannot start from quantized weights",
            )
        patience = self.early_stopping_patience
        if patience is not None:
            if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
                fail("early_stopping_patience", patience, "must be an integer >= 1")
            elif not self.val_set_size:
                fail(
                    "early_stopping_patience",
                    patience,
                    f"stops on the evaluation loss: it needs a held-out set ({self.name('val_set_size')})",
                )
            elif not (isinstance(self.save_steps, int) and isinstance(self.eval_steps, int)):
                fail(
                    "early_stopping_patience",
                    patience,
                    f"needs {self.name('save_steps')} and {self.name('eval_steps')} (evaluations per epoch or saves "
                    "per epoch do not count), as Axolotl requires",
                )
            elif self.save_steps % self.eval_steps:
                fail(
                    "early_stopping_patience",
                    patience,
                    f"needs {self.name('save_steps')}={self.save_steps} to be a multiple of "
                    f"{self.name('eval_steps')}={self.eval_steps}: the best model is kept at checkpoints",
                )

    def _check_reward_model(self, fail) -> None:
        """reward_model: a one-score sequence classifier on bradley_terry pairs, fully fine-tuned."""
        bradley_terry = [
            i for i, e in enumerate(self.datasets or []) if isinstance(e, dict) and e.get("type") == "bradley_terry"
        ]
        if self.reward_model is not True:
            if not isinstance(self.reward_model, bool):
                fail("reward_model", self.reward_model, "must be true or false")
            for key, what in (
                ("num_labels", "a classification head"),
                ("center_rewards_coefficient", "a reward-model setting"),
            ):
                if getattr(self, key) is not None:
                    fail(
                        key,
                        getattr(self, key),
                        f"is {what}; offloadkit trains it for {self.name('reward_model')}: true only",
                    )
            if bradley_terry:
                fail(
                    "datasets",
                    self.datasets,
                    f"(entry {bradley_terry[0]}) is reward-model data; it needs {self.name('reward_model')}: true",
                )
            return
        if self.model_class != "AutoModelForSequenceClassification" or self.num_labels != 1:
            fail(
                "reward_model",
                True,
                f"trains a one-score classifier: set {self.name('model_class')}: "
                f"AutoModelForSequenceClassification and {self.name('num_labels')}: 1",
            )
        if self.lora_rank:
            fail(
                "reward_model",
                True,
                f"is trained as a full fine-tune here; drop the LoRA adapter ({self.name('lora_rank')})",
            )
        if self.rl is not None:
            fail("reward_model", True, f"and {self.name('rl')} are different trainings; keep one")
        if not isinstance(self.datasets, list) or len(bradley_terry) != len(self.datasets):
            fail("reward_model", True, f"trains on pairs: give {self.name('datasets')} of type bradley_terry")
        for key in ("sample_packing", "min_sample_len"):
            if getattr(self, key):
                fail(key, getattr(self, key), f"is not done for {self.name('reward_model')}: true")
        coefficient = self.center_rewards_coefficient
        if coefficient is not None and (
            isinstance(coefficient, bool) or not isinstance(coefficient, (int, float)) or coefficient < 0
        ):
            fail("center_rewards_coefficient", coefficient, "must be a number >= 0, e.g. 0.01")

    def _check_rl(self, fail) -> None:
        """rl: dpo and its preference datasets; preference keys without it."""
        pairs = [
            i
            for i, e in enumerate(self.datasets or [])
            if isinstance(e, dict) and ("field_chosen" in e or "field_rejected" in e)
        ]
        kto = [i for i, e in enumerate(self.datasets or []) if isinstance(e, dict) and e.get("type") == "kto"]
        for key in ("kto_desirable_weight", "kto_undesirable_weight"):
            value = getattr(self, key)
            if value is not None and self.rl != "kto":
                fail(key, value, f"weighs KTO's loss; it needs {self.name('rl')}: kto")
            elif value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                fail(key, value, "must be a positive number, e.g. 1.0")
        if self.rl is None:
            if self.rl_beta is not None:
                fail("rl_beta", self.rl_beta, f"is DPO's and KTO's beta; it needs {self.name('rl')}: dpo or kto")
            if pairs:
                fail("datasets", self.datasets, f"(entry {pairs[0]}) is preference data; train it with rl: dpo")
            if kto:
                fail("datasets", self.datasets, f"(entry {kto[0]}) is KTO data; train it with rl: kto")
            return
        if self.rl not in ("dpo", "kto"):
            fail("rl", self.rl, "must be dpo or kto (preference training with TRL's DPO or KTO trainer)")
            return
        if self.rl_beta is not None and (
            isinstance(self.rl_beta, bool) or not isinstance(self.rl_beta, (int, float)) or self.rl_beta <= 0
        ):
            fail("rl_beta", self.rl_beta, "must be a positive number, e.g. 0.1")
        if not isinstance(self.datasets, list) or not self.datasets:
            fail("rl", self.rl, f"trains on preference pairs: give {self.name('datasets')} of type chat_template")
        else:
            wanted = "chat_template" if self.rl == "dpo" else "kto"
            what = (
                "preference pairs of type chat_template (a conversation with field_chosen and field_rejected answers)"
                if self.rl == "dpo"
                else "labelled completions of type kto"
            )
            for i, entry in enumerate(self.datasets):
                if isinstance(entry, dict) and entry.get("type") != wanted:
                    fail("datasets", entry.get("type"), f"(entry {i}): {self.name('rl')}: {self.rl} reads {what}")
        for key in ("sample_packing", "pad_to_sequence_len"):
            if getattr(self, key) is True:
                fail(key, True, f"is not done for {self.name('rl')}: {self.rl} (its trainer pads each batch)")
        if self.min_sample_len:
            fail("min_sample_len", self.min_sample_len, f"is not done for {self.name('rl')}: {self.rl}")
        if self.rl == "kto" and isinstance(self.batch_size, int) and self.batch_size < 2:
            fail(
                "batch_size",
                self.batch_size,
                f"must be 2 or more for {self.name('rl')}: kto (its KL term pairs each example with another of the "
                "batch)",
            )


def _float(value: str, key: str, source: str) -> float:
    # PyYAML reads 2e-4 (no dot) as a string; accept what the user obviously meant.
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{source}: {key}={value!r} is not a number; write it like 2e-4 or 0.0002") from None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
