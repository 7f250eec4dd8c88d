"""What an ``offloadkit train`` run is built from: the weights' dtype, the model and tokenizer
(LoRA adapters included), the training data and the Trainer's arguments. The run with
offloadkit (:mod:`offloadkit.cli.train`) and the plain run it is compared with
(:mod:`offloadkit.cli.compare`, also in a process of its own) build theirs here, the same way.
"""

from __future__ import annotations

import os

import torch

from offloadkit.cli.train_config import TrainConfig
from offloadkit.config import ConfigError
from offloadkit.extras import check, needs

__all__ = ["load_dtype", "load_model", "quiet", "training_args", "training_data", "with_lora"]


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


def load_model(cfg: TrainConfig, device: str, dtype: torch.dtype):
    """The model on ``device`` in ``dtype``, its tokenizer and the model's name for the report."""
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
    with needs("offloadkit train"):
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
    with needs("offloadkit train"):
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

    check(("bitsandbytes",), "load_in_4bit (QLoRA)")
    with needs("offloadkit train"):
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    plain = dataclasses.replace(cfg, load_in_4bit=False)
    if cfg.model is None:
        model, tokenizer, name = load_model(plain, "cpu", dtype)
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


def training_data(cfg: TrainConfig, tokenizer):
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


def training_args(cfg: TrainConfig, cuda: bool, **overrides):
    """The Trainer's arguments for ``cfg`` (``overrides`` replace any)."""
    with needs("offloadkit train"):
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


def quiet(trainer):
    """``trainer`` without its printing and progress callbacks (the CLI shows its own)."""
    with needs("offloadkit train"):
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    return trainer


def with_lora(cfg: TrainConfig, model):
    """``model`` with the LoRA adapters ``cfg`` asks for (``lora_rank`` > 0)."""
    from offloadkit.integrations.peft_utils import apply_lora

    return apply_lora(
        model,
        rank=cfg.lora_rank,
        alpha=cfg.lora_alpha,
        target_modules=cfg.lora_target_modules,
        dropout=cfg.lora_dropout,
        modules_to_save=cfg.lora_modules_to_save,
        use_dora=cfg.lora_use_dora,
    )
