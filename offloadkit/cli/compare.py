"""The first steps of a run again without offloadkit, measured like the run with it: the
answer to "what does offloadkit save me, and what does it cost?".

The plain run is the same Trainer on the same model, with the same data order and
batches, without checkpointing or offloading, for ``profile_step + 1`` steps. It runs after
the real run, whose model is already saved: weight values change neither memory nor time,
and on a CPU the process RSS of the real run is then measured before the plain run has
grown the heap.
"""

from __future__ import annotations

import gc

import psutil
import torch

from offloadkit.cli.measure import RunMeasure, StepProbe

__all__ = ["estimated_activation_bytes", "measure_without_offloadkit", "saving"]


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
        return (f"skipped: it would need about {need / 2**30:.1f} GiB of activations and "
                f"{free / 2**30:.1f} GiB of RAM is available")
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


def saving(without: RunMeasure, with_: RunMeasure) -> dict:
    """Peak memory and step time, without -> with, and the relative change."""
    out = {"peak_bytes": [without.peak_bytes, with_.peak_bytes],
           "median_step_s": [without.median_step_s, with_.median_step_s],
           "status": without.status, "note": without.note}
    a, b = out["peak_bytes"]
    out["peak_change"] = (b - a) / a if a and b is not None else None
    ta, tb = out["median_step_s"]
    out["time_change"] = (tb - ta) / ta if ta and tb is not None else None
    return out
