"""``offloadkit train CONFIG.yaml``: fine-tune a causal LM through the Trainer integration.

One flat YAML (or JSON) file holds both the training settings below and the offloading
keys of :class:`~offloadkit.config.OffloadConfig` (``gradient_checkpointing``,
``activation_offloading``, ``layer_offloading``, ...). No downloads: the model is a local
Hugging Face directory or a built-in Llama shape; the data is a local ``.txt``/``.jsonl``
file or the shipped public-domain corpus.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

import torch

from offloadkit.config import ConfigError, OffloadConfig, check_keys, load_mapping

__all__ = ["TrainConfig", "run_train", "default_offload"]


def default_offload(cuda: bool) -> dict:
    """The built-in default: everything that helps on this machine, nothing that cannot work."""
    if cuda:
        return {"gradient_checkpointing": True, "activation_offloading": True, "layer_offloading": True}
    # On a CPU-only machine the activations are CPU memory: moving them to disk saves RAM.
    return {"gradient_checkpointing": True, "activation_offloading": "disk"}


@dataclass
class TrainConfig:
    """Settings of ``offloadkit train`` (besides the offloading keys).

    Attributes:
        model: local Hugging Face model directory; None builds ``model_shape`` from a config.
        model_shape: built-in Llama shape: tiny, small, llama-3.2-1b, llama-3-8b.
        dataset: local .txt or .jsonl file; None uses the shipped public-domain corpus.
        text_field: the JSONL field holding the text.
        output_dir: where the model/adapter, report and plot go.
        seq_len, batch_size, gradient_accumulation_steps, max_steps, learning_rate,
        warmup_steps, logging_steps, seed: the usual.
        lora_rank: LoRA rank on all linear layers (0 or None: full fine-tune).
        dtype: auto (bf16 on GPU, fp32 on CPU), bfloat16, float16 or float32.
        profile_step: the step whose memory timeline is plotted.
        offload: the offloading configuration.
    """

    model: str | None = None
    model_shape: str = "small"
    dataset: str | None = None
    text_field: str = "text"
    output_dir: str = "offloadkit-output"
    seq_len: int = 256
    batch_size: int = 4
    gradient_accumulation_steps: int = 1
    max_steps: int = 40
    learning_rate: float = 1e-3
    warmup_steps: int = 0
    logging_steps: int = 5
    lora_rank: int | None = 8
    dtype: str = "auto"
    seed: int = 0
    profile_step: int = 3
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    @classmethod
    def train_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "offload"]

    @classmethod
    def from_dict(cls, data: dict, source: str = "config", cuda: bool | None = None) -> "TrainConfig":
        cuda = torch.cuda.is_available() if cuda is None else cuda
        data = check_keys(dict(data), cls.train_keys() + OffloadConfig.keys(), source)
        train = {k: v for k, v in data.items() if k in cls.train_keys()}
        offload = {k: v for k, v in data.items() if k in OffloadConfig.keys()}
        if not offload:
            offload = default_offload(cuda)
        config = cls(**train, offload=OffloadConfig.from_dict(offload, source=source))
        config.validate(source)
        return config

    @classmethod
    def from_file(cls, path: str | None) -> "TrainConfig":
        return cls.from_dict(load_mapping(path) if path else {}, source=path or "built-in defaults")

    def validate(self, source: str = "config") -> None:
        from offloadkit.testing.models import LLAMA_SHAPES

        ints = {"seq_len": 2, "batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": 1,
                "warmup_steps": 0, "logging_steps": 1, "seed": 0, "profile_step": 0}
        for key, low in ints.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{source}: {key}={value!r} must be an integer >= {low}")
        if not isinstance(self.learning_rate, (int, float)) or self.learning_rate <= 0:
            raise ConfigError(f"{source}: learning_rate={self.learning_rate!r} must be a positive number")
        if self.lora_rank is not None and (isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int)
                                           or self.lora_rank < 0):
            raise ConfigError(f"{source}: lora_rank={self.lora_rank!r} must be an integer >= 0 (0: full fine-tune)")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(f"{source}: dtype={self.dtype!r} must be auto, bfloat16, float16 or float32")
        if self.model is None and self.model_shape not in LLAMA_SHAPES:
            raise ConfigError(f"{source}: model_shape={self.model_shape!r} is unknown; use one of {sorted(LLAMA_SHAPES)}")
        if self.model is not None and not os.path.isdir(self.model):
            raise ConfigError(f"{source}: model={self.model!r} is not a directory; give a local Hugging Face model "
                              "directory (offloadkit train does not download) or omit it for the built-in model")
        if self.dataset is not None and not os.path.isfile(self.dataset):
            raise ConfigError(f"{source}: dataset={self.dataset!r} does not exist; give a .txt or .jsonl file or "
                              "omit it for the shipped corpus")
        if self.offload.layer_offloading and not self.lora_rank and self.model is None:
            self.offload._warn("layer_offloading streams frozen weights; with a full fine-tune (lora_rank 0) "
                               "there are none, so it has no effect")


def _load_model(cfg: TrainConfig, device: str, dtype: torch.dtype):
    from offloadkit.data import BYTE_VOCAB_SIZE, byte_tokenizer
    from offloadkit.testing.models import LLAMA_SHAPES, build_llama

    if cfg.model is None:
        vocab = max(LLAMA_SHAPES[cfg.model_shape]["vocab_size"], BYTE_VOCAB_SIZE)
        model = build_llama(cfg.model_shape, dtype=dtype, device=device, seed=cfg.seed,
                            attn_implementation="sdpa", vocab_size=vocab, max_position_embeddings=max(cfg.seq_len, 2048))
        return model, byte_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model={cfg.model!r} could not be loaded as a local Hugging Face model: "
                          f"{str(exc).splitlines()[0]}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer


def run_train(cfg: TrainConfig, log=print) -> dict:
    """Fine-tune as ``cfg`` says; returns the report (also written to ``output_dir``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the network
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from offloadkit.cli.report import (
        MemoryTimeline,
        ProgressBar,
        build_report,
        write_report,
    )
    from offloadkit.data import TokenBlocks, load_texts
    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[cfg.dtype]
    torch.manual_seed(cfg.seed)
    model, tokenizer = _load_model(cfg, device, dtype)
    if cfg.lora_rank:
        from offloadkit.integrations.peft_utils import apply_lora

        model = apply_lora(model, rank=cfg.lora_rank)
    dataset = TokenBlocks(tokenizer, load_texts(cfg.dataset, cfg.text_field), cfg.seq_len)
    args = TrainingArguments(
        output_dir=cfg.output_dir, per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_steps, lr_scheduler_type="cosine",
        logging_steps=cfg.logging_steps, save_strategy="no", report_to=[], disable_tqdm=True,
        seed=cfg.seed, remove_unused_columns=False, use_cpu=not cuda, dataloader_num_workers=0,
    )

    class OffloadTrainer(ActivationOffloadingMixin, Trainer):
        pass

    trainer = OffloadTrainer(model=model, args=args, train_dataset=dataset, offload_config=cfg.offload)
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    tokens_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * cfg.seq_len
    progress = ProgressBar(cfg.max_steps, tokens_per_step, log)
    timeline = MemoryTimeline(trainer, cfg.profile_step)
    trainer.add_callback(progress)
    trainer.add_callback(timeline)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = trainer.train()
    elapsed = time.perf_counter() - start
    report = build_report(cfg, trainer, result, progress, timeline, elapsed, tokens_per_step)
    os.makedirs(cfg.output_dir, exist_ok=True)
    save_dir = os.path.join(cfg.output_dir, "adapter" if cfg.lora_rank else "model")
    model.save_pretrained(save_dir)  # offloading is detached: an ordinary model/adapter
    tokenizer.save_pretrained(save_dir)
    report["saved_to"] = save_dir
    write_report(report, cfg.output_dir, timeline, log)
    return report
