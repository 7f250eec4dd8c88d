"""A short run of a Hugging Face ``Trainer`` with the offloading mixin, timed step by step: what
the Trainer-route GPU tests and benchmarks measure (step time, the engine's waits and counters
over each step, the run's configuration as ``prepare()`` settled it)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ROUTE_SHAPE", "StepRecord", "train_timed"]

# The Trainer route's model in those tests and benchmarks: 4 layers 2048 wide, its optimizer
# state about half a step's time on the link each way at 8,192 tokens; byte tokens.
ROUTE_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=259,
)


@dataclass
class StepRecord:
    """One optimizer step of :func:`train_timed`.

    Attributes:
        seconds: wall time of the step, the GPU synchronised at both ends.
        stats: the activation engine's counters over the step (``OffloadStats``; None when
            the run has no engine).
        config: the ``OffloadConfig`` the run applied.
    """

    seconds: float
    stats: Any
    config: Any


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train_timed(model, offload_config: dict, *, output_dir: str, steps: int, seq_len: int) -> list[StepRecord]:
    """Train ``model`` for ``steps`` steps of one ``seq_len``-token block of the built-in text
    (byte tokens: the model's vocabulary must hold 259), through a ``Trainer`` with
    :class:`~offloadkit.integrations.trainer.ActivationOffloadingMixin` and ``offload_config``;
    no clipping, bf16 on a GPU. The engine's counters start again at every step."""
    import transformers

    from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts
    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    records: list[StepRecord] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            _synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _synchronize()
            seconds = time.perf_counter() - self.start
            runtime = trainer.offload_runtime  # the run's (None once train() ends)
            manager, stats = runtime.manager, None
            if manager is not None:
                stats = manager.collect_stats()
                manager.reset_stats()
            records.append(StepRecord(seconds, stats, runtime.config))

    args = transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=1,
        max_steps=steps,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        bf16=torch.cuda.is_available(),
        max_grad_norm=0.0,
        learning_rate=1e-5,
        remove_unused_columns=False,
    )
    trainer = type("T", (ActivationOffloadingMixin, transformers.Trainer), {})(
        model=model,
        args=args,
        train_dataset=TokenBlocks(byte_tokenizer(), load_texts() * 8, seq_len),
        callbacks=[Clock()],
        offload_config=offload_config,
    )
    trainer.train()
    return records
