"""The peak resident memory (RSS) of this process over a span of time.

Reading RSS after each step misses what the step held in the middle of it. On Linux the
kernel keeps a high-water mark (``VmHWM``) that writing ``5`` to ``/proc/self/clear_refs``
resets, which gives the exact peak of a span at no cost; elsewhere a thread samples RSS.
"""

from __future__ import annotations

import re
import threading

import psutil

__all__ = ["PeakRss"]

_HWM = re.compile(r"^VmHWM:\s+(\d+)\s+kB", re.MULTILINE)


def _read_hwm() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            match = _HWM.search(f.read())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return _read_hwm() is not None


class PeakRss:
    """``start()`` ... ``stop()`` -> the most RSS the process had in between, in bytes.

    Args:
        interval: seconds between samples where the kernel's high-water mark is not
            available.
    """

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.method = ""
        self._proc = psutil.Process()
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "PeakRss":
        self._peak = self._proc.memory_info().rss
        if _reset_hwm():
            self.method = "kernel high-water mark"
            return self
        self.method = f"sampled every {self.interval * 1000:g} ms"
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="offloadkit-rss", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def stop(self) -> int:
        """End the span; returns its peak RSS in bytes."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        else:
            hwm = _read_hwm()
            if hwm is not None:
                self._peak = max(self._peak, hwm)
        return max(self._peak, self._proc.memory_info().rss)
