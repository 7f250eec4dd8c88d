"""What ``offloadkit train`` shows while it runs and writes when it ends: a progress bar
(loss, tokens/s, memory), and a report answering "what does offloadkit save me, and what
does it cost?" (peak memory and step time without -> with offloadkit), with the loss curve,
bytes offloaded per tier, time spent waiting and where the memory went."""

from __future__ import annotations

import json
import os
import resource
from typing import Any

import torch

from offloadkit.cli.measure import device_bytes

TrainerCallback: Any
try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - the train command needs transformers anyway
    TrainerCallback = object

__all__ = ["ProgressBar", "offload_probes", "build_report", "format_report", "write_report"]

GiB = float(1 << 30)


def _manager(trainer):
    runtime = getattr(trainer, "offload_runtime", None)
    return runtime, getattr(runtime, "manager", None)


def offload_probes(trainer):
    """``(host bytes holding offloaded data, bytes on disk)`` readers for the memory timeline."""

    def host() -> int:
        runtime, manager = _manager(trainer)
        total = 0
        if manager is not None:
            total += manager.tier.host_bytes_in_use()
        if runtime is not None and runtime.streamer is not None:
            total += runtime.streamer.pool.bytes_in_use
        return total

    def disk() -> int:
        _, manager = _manager(trainer)
        if manager is None:
            return 0
        return manager.tier.bytes_on_disk()

    return host, disk


class ProgressBar(TrainerCallback):
    """A progress bar with loss, tokens/s and memory (GPU allocated, or RSS on CPU)."""

    def __init__(self, tokens_per_step: int, step_times: list[float], show: bool = True) -> None:
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self.tokens_per_step = tokens_per_step
        self.step_times = step_times  # filled by the StepProbe
        self.losses: list[tuple[int, float]] = []
        self.step = 0
        self.total = 0
        self._bar: Any = None  # a tqdm bar while training runs
        self._show = show

    def on_train_begin(self, args, state, control, **kwargs):
        self.total = state.max_steps
        self.step = state.global_step
        if self._show:
            self._bar = self._tqdm(
                total=state.max_steps, initial=state.global_step, desc="train", unit="step", dynamic_ncols=True
            )

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step
        if self._bar is not None:
            self._bar.update(1)
            self._postfix()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append((state.global_step, float(logs["loss"])))
            if self._bar is not None:
                self._postfix()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """End the bar's line (idempotent), so whatever is printed next starts on its own line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _postfix(self) -> None:
        recent = self.step_times[-5:]
        tps = self.tokens_per_step * len(recent) / sum(recent) if recent else 0.0
        mem = "gpu" if torch.cuda.is_available() else "rss"
        self._bar.set_postfix(
            loss=f"{self.losses[-1][1]:.3f}" if self.losses else "-",
            tok_s=f"{tps:.0f}",
            **{mem: f"{device_bytes() / GiB:.2f}G"},
        )


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def build_report(trainer, losses: list, with_measure, elapsed: float, tokens_per_step: int, describe: dict) -> dict:
    """The run's figures as a JSON-serialisable dict.

    Args:
        trainer: the trained Trainer (offloadkit's mixin).
        losses: ``(step, loss)`` as logged.
        with_measure: the :class:`~offloadkit.cli.measure.RunMeasure` of the run.
        elapsed: seconds in ``train()``.
        tokens_per_step: tokens per optimizer step.
        describe: model and setting descriptions (name, fine-tune, dtype, shape of a step).
    """
    model = trainer.model
    offload = trainer.offload_report or {}
    streaming = offload.get("layer_streaming") or {}
    trainable_streamed = bool(streaming.get("trainable"))
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    opt_state = 0
    if trainer.optimizer is not None:
        for state in trainer.optimizer.state.values():
            opt_state += _tensor_bytes(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    # BackwardAdamW keeps its state in host memory and frees each gradient at its update.
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    state_on_host = bool(getattr(inner, "updates_in_backward", None) is not None)
    gradients = _tensor_bytes(trainable)
    if state_on_host and inner.updates_in_backward:
        gradients = max((p.numel() * p.element_size() for p in trainable), default=0)
    steps = max(1, len(with_measure.step_times))
    acts = offload.get("activations") or {}
    disk = (offload.get("storage") or {}).get("disk") or {}
    median = with_measure.median_step_s or 0.0
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        **describe,
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "tokens_per_step": tokens_per_step,
        "steps": len(with_measure.step_times),
        "first_loss": losses[0][1] if losses else None,
        "final_loss": losses[-1][1] if losses else None,
        "losses": losses,
        "median_step_s": median,
        "tokens_per_s": tokens_per_step / median if median else 0.0,
        "train_seconds": elapsed,
        # Peaks over the training steps (the probe resets the counters at every step).
        "peak_gpu_bytes": max(with_measure.step_peaks) if cuda and with_measure.step_peaks else None,
        "peak_gpu_reserved_bytes": with_measure.peak_reserved_bytes if cuda else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
        "checkpointing_active": offload.get("checkpointing_active", False),
        "offloaded": {
            "activations_to_ram_bytes_per_step": max(0, acts.get("offloaded_bytes", 0) - disk.get("bytes_written", 0))
            // steps,
            "activations_to_disk_bytes_per_step": disk.get("bytes_written", 0) // steps,
            "frozen_weights_streamed_bytes": 0 if trainable_streamed else streaming.get("streamed_bytes", 0),
            "weights_loaded_bytes_per_step": streaming.get("loaded_bytes", 0) // steps,
        },
        "waited_seconds": {
            "gpu_for_activations": acts.get("wait_seconds", 0.0),
            "gpu_for_weights": streaming.get("wait_seconds", 0.0),
            "host_for_disk": acts.get("host_wait_seconds", 0.0),
        },
        "memory": {
            "trainable_parameters_bytes": _tensor_bytes(trainable),
            "frozen_parameters_bytes": _tensor_bytes(p for p in params if not p.requires_grad),
            # A full fine-tune streams trainable weights, a LoRA model its frozen base.
            "frozen_parameters_streamed_from_host_bytes": 0
            if trainable_streamed
            else streaming.get("streamed_bytes", 0),
            "trainable_parameters_streamed_from_host_bytes": streaming.get("streamed_bytes", 0)
            if trainable_streamed
            else 0,
            "gradients_bytes": gradients,  # held on the GPU at once
            "optimizer_state_bytes": opt_state,
            "optimizer_state_in_host_memory": state_on_host,
        },
        "offload": offload,
        "notes": list(offload.get("notes", [])),
    }


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / GiB:.3f} GiB"


def _pct(x) -> str:
    return "" if x is None else f" ({x * 100:+.0f}%)"


def _seconds(x) -> str:
    return "n/a" if x is None else f"{x:.3f} s"


def _comparison_lines(report: dict) -> list[str]:
    c = report["comparison"]
    memory = "peak GPU memory" if report["device"] != "cpu" else "peak memory (process RSS)"
    (pa, pb), (ta, tb) = c["peak_bytes"], c["median_step_s"]
    first, last = c.get("compared_steps") or (None, None)
    over = f"step {last}" if first == last else f"median of steps {first}-{last}"
    step = f"memory at step {report.get('profile_step')}; step time: {over} of each run"
    if c["status"] != "ok" or pa is None or pb is None:
        if c["status"] == "ok":
            return [f"  without -> with offloadkit ({step}): no memory sample was taken in that step"]
        return [
            f"  without -> with offloadkit ({step}): without offloadkit {c['status']} ({c['note']}); "
            f"with offloadkit: {memory} {_gib(pb)}, step time {_seconds(tb)}"
        ]
    spread = c.get("step_s_spread") or [None, None]
    times = f"step time {ta:.3f} -> {tb:.3f} s{_pct(c['time_change'])}"
    if None not in spread:
        (a_lo, a_hi), (b_lo, b_hi) = spread
        times = (
            f"step time {ta:.3f} ({a_lo:.3f}-{a_hi:.3f}) -> {tb:.3f} ({b_lo:.3f}-{b_hi:.3f}) s{_pct(c['time_change'])}"
        )
        if a_lo <= b_hi and b_lo <= a_hi:
            times += ", within the step-to-step spread"
    lines = [
        f"  without -> with offloadkit ({step}):",
        f"    {memory} {pa / GiB:.3f} -> {pb / GiB:.3f} GiB{_pct(c['peak_change'])}, {times}",
    ]
    if report["device"] == "cpu":
        lines.append("    (each side measured in a process of its own; median step, fastest-slowest in brackets)")
    return lines


def format_report(report: dict) -> str:
    """The report as the text printed at the end of a run."""
    mem, off, wait = report["memory"], report["offloaded"], report["waited_seconds"]
    first, final = report["first_loss"], report["final_loss"]
    loss = f"loss {first:.3f} -> {final:.3f} (logged first -> last)" if first is not None else "no loss logged"
    start = report.get("resumed_from")
    resumed = [f"  resumed  from step {start['step']} ({start['checkpoint']})"] if start else []
    lines = [
        f"offloadkit train report ({report['device']}, torch {report['torch']})",
        f"  model    {report['model']}, {report['parameters'] / 1e6:.2f}M parameters, {report['fine_tune']}, "
        f"{report['dtype']}; {report['tokens_per_step']} tokens per step ({report['step_shape']})",
        f"  memory   {report['offload_summary']}",
        *_comparison_lines(report),
        f"  training {report['steps']} steps in {report['train_seconds']:.1f} s, {loss}, "
        f"{report['tokens_per_s']:.0f} tokens/s",
        *resumed,
        f"  offloaded per step: activations {_gib(off['activations_to_ram_bytes_per_step'])} to RAM, "
        f"{_gib(off['activations_to_disk_bytes_per_step'])} to disk; weights streamed "
        f"{_gib(off['weights_loaded_bytes_per_step'])}",
    ]
    if report["device"] != "cpu":
        lines.append(
            f"  GPU waited for copies: {wait['gpu_for_activations']:.4f} s activations, "
            f"{wait['gpu_for_weights']:.4f} s weights"
        )
    if wait["host_for_disk"]:
        lines.append(f"  waited for disk reads: {wait['host_for_disk']:.4f} s in all")
    lines += [
        "  where the memory went:",
        f"    trainable parameters {_gib(mem['trainable_parameters_bytes'])} (+ gradients "
        f"{_gib(mem['gradients_bytes'])} at once, optimizer state {_gib(mem['optimizer_state_bytes'])}"
        f"{' in host memory' if mem.get('optimizer_state_in_host_memory') else ''})"
        + (
            f", of which {_gib(mem['trainable_parameters_streamed_from_host_bytes'])} live in pinned host memory"
            if mem.get("trainable_parameters_streamed_from_host_bytes")
            else ""
        ),
        f"    frozen parameters    {_gib(mem['frozen_parameters_bytes'])}, of which "
        f"{_gib(mem['frozen_parameters_streamed_from_host_bytes'])} live in pinned host memory",
    ]
    if len(report.get("ranks") or []) > 1:
        from offloadkit.cli.distributed import rank_lines

        lines += [
            f"  {len(report['ranks'])} processes, {report.get('parallel', 'ddp').upper()} (figures above are "
            "rank 0's; tokens count all ranks):",
            *rank_lines(report["ranks"]),
        ]
    lines += [f"  note: {note}" for note in report["notes"]]
    if report.get("sample"):
        lines.append(f"  sample from the trained model: {report['sample']!r}")
    lines.append(f"  saved: {report.get('saved_to')} ({report.get('load_hint')})")
    plot = report.get("memory_plot") or f"plot {report.get('plot_note')}"
    lines.append(f"  report: {report['report_path']}; {plot}")
    return "\n".join(lines)


def write_report(report: dict, out_dir: str, log=print, shown_dir: str | None = None) -> str:
    """Write ``report.json`` and ``report.md`` to ``out_dir``, print the text; returns it.
    ``shown_dir``: where the files will be once the run has ended, which the report names
    (default ``out_dir``)."""
    report["report_path"] = os.path.join(shown_dir or out_dir, "report.json")
    text = format_report(report)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("```\n" + text + "\n```\n")
    log(text)
    return text
