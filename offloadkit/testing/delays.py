"""Injected device delays for race tests: a sleep on the copy's stream before each copy.

A missing ``wait_event`` / ``wait_stream`` usually passes by luck because copies finish
before anyone reads their destination; with every copy delayed by milliseconds the same
bug shows up as wrong numbers. Registered through the copy observers of
:mod:`offloadkit.runtime.copies`, never through a knob on a product class.
"""

from __future__ import annotations

from offloadkit.runtime.copies import add_copy_observer, device_sleep

__all__ = ["slow_copies"]


def slow_copies(cycles: int, kinds: tuple[str, ...] = ("d2h", "h2d")):
    """Delay every device copy of the given kinds by ``cycles`` GPU cycles.

    Returns:
        A handle: use it as a context manager, or call ``remove()``.

    Example:
        >>> with slow_copies(20_000_000):
        ...     loss = run_step(model, batch, ctx)  # doctest: +SKIP
    """

    def observer(stream, kind: str) -> None:
        if kind in kinds:
            device_sleep(cycles)

    return add_copy_observer(observer)
