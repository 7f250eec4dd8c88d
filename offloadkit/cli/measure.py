"""Measuring training steps the same way with and without offloadkit: step times, the peak
memory of one step, and that step's memory timeline with its phases (forward, backward,
optimizer).

Memory is GPU memory allocated by PyTorch on a GPU, and the process RSS on a CPU-only
machine. RSS rarely falls (the C allocator keeps freed memory for reuse), so on a CPU it
shows what the process has needed so far; the CLI measures the run with offloadkit first
for that reason.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import psutil
import torch

TrainerCallback: Any
try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - the train command needs transformers anyway
    TrainerCallback = object

__all__ = ["StepProbe", "RunMeasure", "device_bytes", "timed_steps"]


def device_bytes() -> int:
    """GPU memory allocated by PyTorch, or the process RSS without a GPU."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    return psutil.Process().memory_info().rss


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_steps(times: list, count: int | None = None) -> list:
    """The step times a median is taken over: steps 0 to ``count - 1`` (default: all), less
    step 0, which builds the optimizer state (unless it is the only one)."""
    times = times[:count]
    return times[1:] or times


@dataclass
class RunMeasure:
    """What one run measured.

    Attributes:
        label: "without offloadkit" or "with offloadkit".
        status: "ok", "out of memory" or "skipped".
        note: why, when not ok.
        step_times: seconds per optimizer step, in order.
        step_peaks: peak GPU memory allocated per step (empty without a GPU).
        peak_reserved_bytes: the most GPU memory the allocator reserved in any step.
        profile_step: the step whose timeline was sampled.
        start_bytes: memory when the profiled step began.
        peak_bytes: peak memory of the profiled step.
        samples: ``(seconds, memory, host offload, disk)`` through the profiled step.
        phases: ``(name, start, end)`` seconds within the profiled step.
    """

    label: str
    status: str = "ok"
    note: str = ""
    step_times: list = field(default_factory=list)
    step_peaks: list = field(default_factory=list)
    peak_reserved_bytes: int | None = None
    profile_step: int | None = None
    start_bytes: int | None = None
    peak_bytes: int | None = None
    samples: list = field(default_factory=list)
    phases: list = field(default_factory=list)

    @property
    def median_step_s(self) -> float | None:
        """The median over the whole run (see :func:`timed_steps`)."""
        times = timed_steps(self.step_times)
        return statistics.median(times) if times else None

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "status": self.status,
            "note": self.note,
            "step_times_s": self.step_times,
            "median_step_s": self.median_step_s,
            "step_peaks": self.step_peaks,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "profile_step": self.profile_step,
            "start_bytes": self.start_bytes,
            "peak_bytes": self.peak_bytes,
            "phases": self.phases,
        }


class StepProbe(TrainerCallback):
    """A Trainer callback timing every step and sampling one step's memory and phases.

    Args:
        measure: the :class:`RunMeasure` to fill.
        profile_step: the step to sample, counted from 0 at the start of ``train()``.
        extra: callables returning further byte counts per sample (host offload, disk).
        interval: seconds between samples.
    """

    def __init__(
        self,
        measure: RunMeasure,
        profile_step: int,
        extra: tuple[Callable[[], int], Callable[[], int]] = (lambda: 0, lambda: 0),
        interval: float = 0.0005,
    ) -> None:
        self.measure = measure
        self.profile_step = profile_step
        self.extra = extra
        self.interval = interval
        self._t0 = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._handles: list = []
        self._open: dict[str, float] = {}
        self._first = 0  # global step at train begin (a resumed run starts past 0)

    # -- phases ------------------------------------------------------------------------------
    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _begin(self, name: str) -> None:
        self._open[name] = self._now()

    def _end(self, name: str) -> None:
        if name in self._open:
            self.measure.phases.append((name, self._open.pop(name), self._now()))

    def _attach(self, model) -> None:
        def pre(module, args, kwargs=None):
            if module.training and torch.is_grad_enabled():
                self._end("backward")  # gradient accumulation: the next micro-batch starts
                self._begin("forward")

        def post(module, args, output):
            if "forward" in self._open:
                self._end("forward")
                self._begin("backward")

        self._handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- sampling ----------------------------------------------------------------------------
    def _sample(self) -> None:
        host, disk = self.extra
        while True:  # at least one sample, however short the step
            self.measure.samples.append((self._now(), device_bytes(), host(), disk()))
            if self._stop.wait(self.interval):
                break

    # -- callbacks ---------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._first = state.global_step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        _sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._t0 = time.perf_counter()
        if state.global_step - self._first == self.profile_step and self._thread is None and model is not None:
            self.measure.profile_step = state.global_step
            self.measure.start_bytes = device_bytes()
            self._attach(model)
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="offloadkit-memory-sampler", daemon=True)
            self._thread.start()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._handles:
            self._end("backward")
            self._begin("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._handles:
            self._end("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        self.measure.step_times.append(time.perf_counter() - self._t0)
        if torch.cuda.is_available():
            self.measure.step_peaks.append(torch.cuda.max_memory_allocated())
            self.measure.peak_reserved_bytes = max(
                self.measure.peak_reserved_bytes or 0, torch.cuda.max_memory_reserved()
            )
        if self._handles:
            self.stop()
            samples = [s[1] for s in self.measure.samples]
            if torch.cuda.is_available():
                self.measure.peak_bytes = self.measure.step_peaks[-1]
            elif samples:
                self.measure.peak_bytes = max(samples)

    def on_train_end(self, args, state, control, **kwargs):
        self.stop()

    def stop(self) -> None:
        """End sampling and detach the hooks (also after an error or an interrupt)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._detach()
        for name in list(self._open):
            self._end(name)
