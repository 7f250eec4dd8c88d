"""What ``offloadkit train`` shows while it runs and writes when it ends: a progress bar
(loss, tokens/s, memory), a report (peak memory, bytes offloaded per tier, time the GPU
waited, where the memory went) and a plot of memory over one training step."""

from __future__ import annotations

import json
import os
import resource
import threading
import time

import psutil
import torch

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - the train command needs transformers anyway
    TrainerCallback = object

__all__ = ["ProgressBar", "MemoryTimeline", "build_report", "write_report"]

GiB = float(1 << 30)


def _device_bytes() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else psutil.Process().memory_info().rss


def _disk_bytes(trainer) -> int:
    runtime = getattr(trainer, "offload_runtime", None)
    manager = getattr(runtime, "manager", None)
    if manager is None:
        return 0
    disk = manager.tier if manager.tier.name == "disk" else getattr(manager.tier, "disk", None)
    return disk.bytes_on_disk if disk is not None else 0


def _host_offload_bytes(trainer) -> int:
    """Host bytes holding offloaded data right now: activation buffers in use, disk staging,
    and the pinned copies of streamed weights."""
    runtime = getattr(trainer, "offload_runtime", None)
    if runtime is None:
        return 0
    total = 0
    manager = runtime.manager
    if manager is not None:
        tier = manager.tier
        for t in (tier, getattr(tier, "ram", None), getattr(tier, "disk", None)):
            pool = getattr(t, "pool", None)
            if pool is not None:
                total += pool.bytes_in_use
    if runtime.streamer is not None:
        total += runtime.streamer.pool.bytes_in_use
    return total


class ProgressBar(TrainerCallback):
    """A progress bar with loss, tokens/s and device memory (GPU allocated, or RSS on CPU)."""

    def __init__(self, total_steps: int, tokens_per_step: int, log=print) -> None:
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self.total = total_steps
        self.tokens_per_step = tokens_per_step
        self.step_times: list[float] = []
        self.losses: list[tuple[int, float]] = []
        self._bar = None
        self._t0 = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._bar = self._tqdm(total=self.total, desc="train", unit="step", dynamic_ncols=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.step_times.append(time.perf_counter() - self._t0)
        self._bar.update(1)
        self._postfix()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append((state.global_step, float(logs["loss"])))
            self._postfix()

    def on_train_end(self, args, state, control, **kwargs):
        if self._bar is not None:
            self._bar.close()

    def _postfix(self) -> None:
        recent = self.step_times[-5:]
        tps = self.tokens_per_step * len(recent) / sum(recent) if recent else 0.0
        mem = "gpu" if torch.cuda.is_available() else "rss"
        self._bar.set_postfix(loss=f"{self.losses[-1][1]:.3f}" if self.losses else "-", tok_s=f"{tps:.0f}",
                              **{mem: f"{_device_bytes() / GiB:.2f}G"})


class MemoryTimeline(TrainerCallback):
    """Samples device memory and host offload bytes every ~0.5 ms during one step."""

    def __init__(self, trainer, step: int) -> None:
        self.trainer = trainer
        self.step = step
        self.samples: list[tuple[float, int, int, int]] = []  # (seconds, device, host offload, disk) bytes
        self._stop = threading.Event()
        self._thread = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self._thread is not None and not self._stop.is_set():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._stop.set()
            self._thread.join()

    def _run(self) -> None:
        start = time.perf_counter()
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - start, _device_bytes(), _host_offload_bytes(self.trainer),
                                 _disk_bytes(self.trainer)))
            time.sleep(0.0005)

    def plot(self, path: str) -> str | None:
        """Write the PNG; returns None (and writes nothing) when matplotlib is missing."""
        if not self.samples:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        t = [s[0] * 1000 for s in self.samples]
        fig, ax = plt.subplots(figsize=(9, 4))
        label = "GPU allocated" if torch.cuda.is_available() else "process RSS"
        ax.plot(t, [s[1] / GiB for s in self.samples], label=label, color="tab:blue")
        ax.plot(t, [s[2] / GiB for s in self.samples], label="host memory holding offloaded bytes", color="tab:orange")
        if any(s[3] for s in self.samples):
            ax.plot(t, [s[3] / GiB for s in self.samples], label="offloaded bytes on disk", color="tab:green")
        ax.set_xlabel(f"time in training step {self.step} (ms)")
        ax.set_ylabel("GiB")
        ax.set_title("Memory over one training step")
        ax.legend(loc="upper left")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def build_report(cfg, trainer, result, progress: ProgressBar, timeline: MemoryTimeline, elapsed: float,
                 tokens_per_step: int) -> dict:
    model = trainer.model
    offload = trainer.offload_report or {}
    streamed = (offload.get("layer_streaming") or {}).get("streamed_bytes", 0)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    frozen_bytes = _tensor_bytes(p for p in params if not p.requires_grad)
    opt_state = 0
    if trainer.optimizer is not None:
        for state in trainer.optimizer.state.values():
            opt_state += _tensor_bytes(state.values())
    steps = max(1, len(progress.step_times))
    acts = offload.get("activations") or {}
    disk = (offload.get("storage") or {}).get("disk") or {}
    times = sorted(progress.step_times[1:] or progress.step_times)
    median = times[len(times) // 2] if times else 0.0
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "steps": len(progress.step_times),
        "final_loss": progress.losses[-1][1] if progress.losses else float(result.training_loss),
        "losses": progress.losses,
        "median_step_s": median,
        "tokens_per_s": tokens_per_step / median if median else 0.0,
        "train_seconds": elapsed,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
        "offloaded": {
            "activations_to_ram_bytes_per_step": max(0, acts.get("offloaded_bytes", 0) - disk.get("bytes_written", 0))
            // steps,
            "activations_to_disk_bytes_per_step": disk.get("bytes_written", 0) // steps,
            "frozen_weights_streamed_bytes": streamed,
            "weights_loaded_bytes_per_step": (offload.get("layer_streaming") or {}).get("loaded_bytes", 0) // steps,
        },
        "gpu_waited_seconds": {
            "activations": acts.get("wait_seconds", 0.0),
            "layer_streaming": (offload.get("layer_streaming") or {}).get("wait_seconds", 0.0),
            "host_blocked_on_disk": acts.get("host_wait_seconds", 0.0),
        },
        "memory": {
            "trainable_parameters_bytes": _tensor_bytes(trainable),
            "frozen_parameters_bytes": frozen_bytes,
            "frozen_parameters_streamed_from_host_bytes": streamed,
            "gradients_bytes": _tensor_bytes(trainable),
            "optimizer_state_bytes": opt_state,
        },
        "offload": offload,
        "notes": offload.get("notes", []),
    }


def _fmt(n) -> str:
    return "n/a" if n is None else f"{n / GiB:.3f} GiB"


def write_report(report: dict, out_dir: str, timeline: MemoryTimeline, log=print) -> None:
    png = timeline.plot(os.path.join(out_dir, "memory_timeline.png"))
    report["memory_plot"] = png
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    mem, off, wait = report["memory"], report["offloaded"], report["gpu_waited_seconds"]
    lines = [
        f"offloadkit train report ({report['device']}, torch {report['torch']})",
        f"  steps {report['steps']}, final loss {report['final_loss']:.4f}, median step {report['median_step_s']:.3f} s, "
        f"{report['tokens_per_s']:.0f} tokens/s",
        f"  peak GPU memory        {_fmt(report['peak_gpu_bytes'])} allocated, {_fmt(report['peak_gpu_reserved_bytes'])} reserved",
        f"  peak process RSS       {_fmt(report['peak_rss_bytes'])}",
        f"  offloaded per step     activations: {_fmt(off['activations_to_ram_bytes_per_step'])} to RAM, "
        f"{_fmt(off['activations_to_disk_bytes_per_step'])} to disk; weights streamed: {_fmt(off['weights_loaded_bytes_per_step'])}",
        f"  GPU waited for copies  {wait['activations']:.4f} s activations, {wait['layer_streaming']:.4f} s weights"
        + (f"; host blocked on disk {wait['host_blocked_on_disk']:.4f} s" if wait["host_blocked_on_disk"] else ""),
        "  where the memory went:",
        f"    trainable parameters {_fmt(mem['trainable_parameters_bytes'])} (+ gradients {_fmt(mem['gradients_bytes'])}, "
        f"optimizer state {_fmt(mem['optimizer_state_bytes'])})",
        f"    frozen parameters    {_fmt(mem['frozen_parameters_bytes'])}, of which {_fmt(mem['frozen_parameters_streamed_from_host_bytes'])} "
        "live in pinned host memory",
    ]
    for note in report["notes"]:
        lines.append(f"  note: {note}")
    lines.append(f"  saved: {report.get('saved_to')}; report: {os.path.join(out_dir, 'report.json')}"
                 + (f"; plot: {png}" if png else "; plot: skipped (pip install 'offloadkit[plot]')"))
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("```\n" + text + "\n```\n")
    log(text)
