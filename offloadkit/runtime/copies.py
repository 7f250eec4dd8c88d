"""Asynchronous copies between host and device, queued on an explicit stream.

Every copy engine (the RAM and disk tiers, layer streaming) queues its device copies
through :func:`copy_on`. Observers registered with :func:`add_copy_observer` run on the
copy's stream just before each copy is queued; race tests use one to put a device-side
sleep there (:func:`device_sleep`), so that a missing wait shows up as wrong numbers
instead of passing by luck. Nothing is registered unless a caller asks.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

__all__ = ["add_copy_observer", "copy_on", "device_sleep"]

_observers: list[Callable] = []
_lock = threading.Lock()


class _ObserverHandle:
    def __init__(self, fn: Callable) -> None:
        self._fn = fn

    def remove(self) -> None:
        with _lock:
            if self._fn in _observers:
                _observers.remove(self._fn)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def add_copy_observer(fn: Callable[[torch.cuda.Stream, str], None]) -> _ObserverHandle:
    """Call ``fn(stream, kind)`` before every device copy (``kind``: ``"d2h"``, ``"h2d"``).

    Returns:
        A handle; ``remove()`` (or leaving its ``with`` block) unregisters ``fn``.
    """
    with _lock:
        _observers.append(fn)
    return _ObserverHandle(fn)


def copy_on(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """Queue ``dst.copy_(src)`` on ``stream`` (the caller has already ordered it after its inputs)."""
    with torch.cuda.stream(stream):
        if _observers:
            kind = "h2d" if dst.device.type == "cuda" else "d2h"
            for fn in list(_observers):
                fn(stream, kind)
        dst.copy_(src, non_blocking=non_blocking)


def device_sleep(cycles: int) -> None:
    """Spin the current stream for about ``cycles`` GPU clock cycles."""
    torch.cuda._sleep(cycles)
