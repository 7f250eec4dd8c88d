"""Injected device delays for race tests: a sleep on the copy's stream before each copy.

A missing ``wait_event`` / ``wait_stream`` usually passes by luck because copies finish
before anyone reads their destination; with every copy delayed by milliseconds the same
bug shows up as wrong numbers. Every device copy of the library is queued by
:func:`offloadkit.transfer.copy.queue_copy` through one function; while a delay is active it
is wrapped here, on the test's side, and put back when the last delay is removed. The
library itself checks nothing per copy.
"""

from __future__ import annotations

import threading

import offloadkit.transfer.copy as _copy
from offloadkit.runtime.copies import device_sleep

__all__ = ["slow_copies"]

_lock = threading.Lock()
_active: list[tuple[int, tuple[str, ...]]] = []
_original = None


def _delayed(dst, src, non_blocking: bool) -> None:
    kind = "h2d" if dst.device.type == "cuda" else "d2h"
    for cycles, kinds in list(_active):
        if kind in kinds:
            device_sleep(cycles)  # on the copy's stream: the copy starts that much later
    _original(dst, src, non_blocking)


class _Delay:
    def __init__(self, item) -> None:
        self._item = item

    def remove(self) -> None:
        global _original
        with _lock:
            if self._item in _active:
                _active.remove(self._item)
            if not _active and _original is not None:
                _copy._enqueue, _original = _original, None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def slow_copies(cycles: int, kinds: tuple[str, ...] = ("d2h", "h2d")) -> _Delay:
    """Delay every device copy of the given kinds (``"d2h"``, ``"h2d"``) by ``cycles`` GPU cycles.

    Returns:
        A handle: use it as a context manager, or call ``remove()``.

    Example:
        >>> with slow_copies(20_000_000):
        ...     loss = run_step(model, batch, ctx)  # doctest: +SKIP
    """
    global _original
    item = (int(cycles), tuple(kinds))
    with _lock:
        if _original is None:
            _original, _copy._enqueue = _copy._enqueue, _delayed
        _active.append(item)
    return _Delay(item)
