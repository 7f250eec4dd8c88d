"""The first steps of a run again without offloadkit, measured like the run with it: the
answer to "what does offloadkit save me, and what does it cost?".

The plain run is the same Trainer on the same model, with the same data order and
batches, without checkpointing or offloading, for ``profile_step + 1`` steps. It runs after
the real run, whose model is already saved: weight values change neither memory nor time.
On a GPU it runs in the same process (the allocator's per-step peak falls between runs).
On a CPU the measure is the process RSS, which never falls: a second run in the same
process would reuse the first one's heap and look free. So there it runs in a process of
its own (``python -m offloadkit.cli.compare``), started fresh like the real run.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import psutil
import torch

from offloadkit.cli.measure import RunMeasure, StepProbe, timed_steps

__all__ = ["estimated_activation_bytes", "measure_without_offloadkit", "measure_in_own_process", "saving"]


def estimated_activation_bytes(model, tokens: int) -> int | None:
    """Rough bytes autograd keeps for backward in one step without checkpointing, from the
    model config (None when the config does not say enough)."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not hidden or not layers:
        return None
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    element = next(model.parameters()).element_size()
    # Measured on Llama blocks: about 10 hidden-sized and 4 MLP-sized values per token and layer.
    return int(tokens * layers * (10 * hidden + 4 * inner) * element)


def _skip_reason(model, tokens: int, cuda: bool) -> str | None:
    if cuda:
        return None  # tried, and an out-of-memory error is the answer
    need = estimated_activation_bytes(model, tokens)
    if need is None:
        return "skipped: the model config does not say how large its activations are"
    free = psutil.virtual_memory().available
    if need > 0.5 * free:
        return (
            f"skipped: it would need about {need / 2**30:.1f} GiB of activations and "
            f"{free / 2**30:.1f} GiB of RAM is available"
        )
    return None


def measure_without_offloadkit(make_trainer, model, profile_step: int, tokens: int) -> RunMeasure:
    """Train ``profile_step + 1`` steps without offloadkit and measure them.

    Args:
        make_trainer: ``make_trainer(max_steps, callbacks)`` -> a plain Hugging Face Trainer.
        model: the model it trains (its gradients are dropped afterwards).
        profile_step: the step to sample, as in the run with offloadkit.
        tokens: tokens per step (to judge whether a CPU run fits in RAM).

    Returns:
        The :class:`RunMeasure`; its status is "out of memory" or "skipped" when the plain
        run did not fit.
    """
    measure = RunMeasure("without offloadkit")
    cuda = torch.cuda.is_available()
    reason = _skip_reason(model, tokens, cuda)
    if reason is not None:
        measure.status, measure.note = "skipped", reason
        return measure
    probe = StepProbe(measure, profile_step)
    trainer = make_trainer(profile_step + 1, [probe])
    out_of_memory = False
    try:
        trainer.train()
    except torch.cuda.OutOfMemoryError:
        out_of_memory = True  # the traceback holds the step's tensors: release it before cleaning up
    finally:
        probe.stop()
        for p in model.parameters():
            p.grad = None
        trainer.optimizer = trainer.lr_scheduler = None
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    if out_of_memory:
        measure.status = "out of memory"
        measure.note = "did not fit on the GPU without offloadkit"
    return measure


def measure_in_own_process(cfg, profile_step: int, tokens: int) -> RunMeasure:
    """:func:`measure_without_offloadkit` in a fresh Python process (CPU runs: see the module
    docstring). ``cfg`` is the resolved TrainConfig of the run.

    Returns:
        The child's :class:`RunMeasure`; "skipped" with the child's last error line when it
        failed.
    """
    from offloadkit.cli.train_config import TrainConfig

    keys = {k: getattr(cfg, k) for k in TrainConfig.train_keys()}
    keys.update(resume_from_checkpoint=None, report_to="none", save_steps=None)
    with tempfile.TemporaryDirectory(prefix="offloadkit-compare-") as work:
        keys["output_dir"] = work
        request = os.path.join(work, "request.json")
        answer = os.path.join(work, "measure.json")
        with open(request, "w", encoding="utf-8") as f:
            json.dump({"train": keys, "profile_step": profile_step, "tokens": tokens}, f)
        proc = subprocess.run(
            [sys.executable, "-m", "offloadkit.cli.compare", request, answer], capture_output=True, text=True
        )
        if proc.returncode != 0 or not os.path.isfile(answer):
            if proc.returncode in (-2, 130):
                raise KeyboardInterrupt
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return RunMeasure("without offloadkit", status="skipped", note=f"the plain run failed: {last[:200]}")
        with open(answer, encoding="utf-8") as f:
            fields = json.load(f)
    return RunMeasure(**fields)


def _child(request_path: str, answer_path: str) -> None:
    """The plain run of :func:`measure_in_own_process`, in this (fresh) process."""
    from transformers import Trainer

    from offloadkit.cli.build import load_dtype, load_model, quiet, trainable, training_args, training_data, with_lora
    from offloadkit.cli.train_config import TrainConfig

    with open(request_path, encoding="utf-8") as f:
        request = json.load(f)
    cfg = TrainConfig(**request["train"])
    dtype = load_dtype(cfg, False)
    torch.manual_seed(cfg.seed)
    model, tokenizer, _ = load_model(cfg, "cpu", dtype)
    if cfg.lora_rank:
        model = with_lora(cfg, model)
    model = trainable(cfg, model)
    data = training_data(cfg, tokenizer)
    dataset, collator = data.train, data.collator

    def plain_trainer(max_steps, callbacks):
        args = training_args(
            cfg, False, max_steps=max_steps, save_strategy="no", report_to="none", logging_strategy="no"
        )
        return quiet(
            Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=callbacks)
        )

    measure = measure_without_offloadkit(plain_trainer, model, request["profile_step"], request["tokens"])
    with open(answer_path, "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(measure), f)


def saving(without: RunMeasure, with_: RunMeasure, profile_step: int) -> dict:
    """Peak memory at ``profile_step`` and step time, without -> with, the relative change,
    and the spread (fastest and slowest step) of each side's step times.

    Both sides' step times are those of steps 0 to ``profile_step`` (less step 0, see
    :func:`~offloadkit.cli.measure.timed_steps`), the steps the plain run measures: the run
    with offloadkit goes on, and its later steps (a warm process, a warm cache) would be
    compared with the plain run's first ones.
    """
    count = profile_step + 1
    times = [timed_steps(without.step_times, count), timed_steps(with_.step_times, count)]
    out: dict[str, Any] = {
        "peak_bytes": [without.peak_bytes, with_.peak_bytes],
        "median_step_s": [statistics.median(t) if t else None for t in times],
        "step_s_spread": [[min(t), max(t)] if t else None for t in times],
        "compared_steps": [min(1, profile_step), profile_step],
        "status": without.status,
        "note": without.note,
    }
    a, b = out["peak_bytes"]
    out["peak_change"] = (b - a) / a if a and b is not None else None
    ta, tb = out["median_step_s"]
    out["time_change"] = (tb - ta) / ta if ta and tb is not None else None
    return out


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _child(sys.argv[1], sys.argv[2])
