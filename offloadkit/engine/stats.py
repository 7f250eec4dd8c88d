"""Counters a user can print, and the clock for time the compute stream spent waiting."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from offloadkit.transfer.completion import order_after

__all__ = ["OffloadStats", "WaitClock"]

_MiB = 1 << 20


@dataclass
class OffloadStats:
    """Cumulative since construction or the last ``reset_stats()``.

    ``offloaded_bytes`` counts bytes held off the device (after dedup and merges);
    ``copied_bytes`` every byte that crossed to the host, including copies a merge gave back;
    ``deduplicated_*`` count saved tensors served by a copy that already existed.
    """

    saved_tensors: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    copied_bytes: int = 0
    deduplicated_tensors: int = 0
    deduplicated_bytes: int = 0
    merged_entries: int = 0  # copies given back because a later save covered them and more
    kept_tensors: int = 0
    kept_bytes: int = 0
    kept_by_reason: Counter = field(default_factory=Counter)
    restored_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    stash_hits: int = 0
    replayed_passes: int = 0  # backward passes that followed the order learned in the previous one
    # Outputs kept for a checkpoint's recompute (fused attention's), also counted above as
    # offloaded or kept (not as saved tensors: autograd never saved them).
    recompute_outputs: int = 0
    wait_seconds_forward: float = 0.0
    wait_seconds_backward: float = 0.0
    host_wait_seconds: float = 0.0  # the host blocked on disk I/O (or on CPU-side copies)

    @property
    def wait_seconds(self) -> float:
        return self.wait_seconds_forward + self.wait_seconds_backward

    def note_kept(self, reason: str, nbytes: int) -> None:
        self.kept_tensors += 1
        self.kept_bytes += nbytes
        self.kept_by_reason[reason] += 1

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["kept_by_reason"] = dict(self.kept_by_reason)
        d["wait_seconds"] = self.wait_seconds
        return d

    def summary(self) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.kept_by_reason.items())) or "none"
        return "\n".join(
            [
                f"saved tensors     {self.saved_tensors}",
                f"offloaded         {self.offloaded_tensors} tensors, {self.offloaded_bytes / _MiB:.1f} MiB",
                f"deduplicated      {self.deduplicated_tensors} tensors, "
                f"{self.deduplicated_bytes / _MiB:.1f} MiB not copied again",
                f"kept on device    {self.kept_tensors} tensors, {self.kept_bytes / _MiB:.1f} MiB ({reasons})",
                f"restored          {self.restored_bytes / _MiB:.1f} MiB",
                f"backward          {self.prefetch_hits} prefetch hits, {self.prefetch_misses} misses, "
                f"{self.stash_hits} still on device, "
                f"{self.replayed_passes} passes in learned order",
                f"compute waited    {self.wait_seconds_forward:.4f} s forward, "
                f"{self.wait_seconds_backward:.4f} s backward"
                + (f"; host blocked on I/O {self.host_wait_seconds:.4f} s" if self.host_wait_seconds else ""),
            ]
        )

    def __str__(self) -> str:
        return self.summary()


class WaitClock:
    """Makes a stream wait on an event (through :func:`~offloadkit.transfer.completion.order_after`,
    as every wait on a transfer) and measures, on the device, how long it stalled.

    Only waits that are still pending on the host side are timed (a pair of timing
    events around ``wait_event``); pairs are read back lazily, once both completed.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._pending: list[tuple] = []

    def wait(self, stream, event, phase: str, stats: OffloadStats) -> None:
        if event is None:
            return  # nothing to wait for
        if hasattr(event, "resolve"):
            # Host-side work first (a disk read): block the host, timed. A failed read raises
            # here, never hands back a buffer it did not fill.
            start = time.perf_counter()
            event = event.resolve()
            stats.host_wait_seconds += time.perf_counter() - start
            if event is None:
                return
        if event.query():
            return
        if stream is None:  # CPU tensors: the host is the consumer
            start = time.perf_counter()
            order_after(None, event)
            stats.host_wait_seconds += time.perf_counter() - start
            return
        if not self.enabled:
            order_after(stream, event)
            return
        began = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        began.record(stream)
        order_after(stream, event)
        end.record(stream)
        self._pending.append((began, end, phase))
        if len(self._pending) > 256:
            self.collect(stats)

    def collect(self, stats: OffloadStats, block: bool = False) -> None:
        keep = []
        for start, end, phase in self._pending:
            if block:
                end.synchronize()
            elif not end.query():
                keep.append((start, end, phase))
                continue
            seconds = start.elapsed_time(end) / 1000.0
            if phase == "forward":
                stats.wait_seconds_forward += seconds
            else:
                stats.wait_seconds_backward += seconds
        self._pending = keep
