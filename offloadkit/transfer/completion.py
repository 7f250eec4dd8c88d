"""When a transfer is done: the one completion contract and the one "order after".

A completion is what a copy or a stored/loaded range hands back: a CUDA event (a copy queued
on a copy stream) or a :class:`FutureCompletion` (host work on an I/O thread, a disk read or
write, that may end with a device copy). Both answer ``query()`` and ``synchronize()``;
:func:`order_after` makes a stream (or the host) wait for either, and the engine's wait clock
(``engine/stats.py:WaitClock``) times the waits of the compute stream on them.
"""

from __future__ import annotations

__all__ = ["FutureCompletion", "order_after"]


class FutureCompletion:
    """Completion of host-side work (a disk read or write on an I/O thread) that may end
    with device work: the future's result is a CUDA event to wait on, or None.

    It answers ``query()`` and ``synchronize()`` like an event; ``resolve()`` blocks the
    host until the host part is done and returns the device event (or None).
    """

    __slots__ = ("future",)

    def __init__(self, future) -> None:
        self.future = future

    def query(self) -> bool:
        if not self.future.done():
            return False
        if self.future.exception() is not None:
            return True  # failed: no device copy is left to wait for
        event = self.future.result()
        return event is None or event.query()

    def resolve(self):
        """The device event, or raise the host part's failure as a fresh exception: the stored
        one would collect every frame it passes through (a whole backward pass, its graph
        and host copies) and keep them alive for as long as the future lives."""
        exc = self.future.exception()
        if exc is not None:
            raise _fresh(exc) from None
        return self.future.result()

    def synchronize(self) -> None:
        if self.future.exception() is not None:
            return
        event = self.future.result()
        if event is not None:
            event.synchronize()


def _fresh(exc: BaseException) -> BaseException:
    try:
        return type(exc)(*exc.args)
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def order_after(stream, completion) -> None:
    """Make ``stream`` (or, with ``stream=None``, the host) wait for ``completion``."""
    if completion is None:
        return
    if stream is None:
        completion.synchronize()
        return
    if isinstance(completion, FutureCompletion):
        if completion.future.exception() is not None:
            return  # the host part failed: nothing was queued on the device
        completion = completion.resolve()
        if completion is None:
            return
    stream.wait_event(completion)
