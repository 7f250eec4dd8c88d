"""The record of one feature :func:`~offloadkit.prepare` attaches: its name, its options, why it
comes where it does in the apply order, how it is built, reported and detached.

Each feature states its record beside its code (``longctx/component.py``,
``checkpointing/component.py``, ...); :mod:`offloadkit.components` lists them in apply order.
(This module holds only the record, so that a feature's ``component.py`` can import it while the
registry imports that ``component.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from offloadkit.options import Options

if TYPE_CHECKING:
    from offloadkit.compose import OffloadRuntime

__all__ = ["Component"]


def _remove(handle: Any) -> None:
    handle.remove()


@dataclass(frozen=True)
class Component:
    """One feature of a run, as :func:`~offloadkit.prepare` builds it.

    Attributes:
        name: the key of its handle in ``runtime.handles``.
        options: its options class; ``build`` gets ``config.options(options)``.
        why_here: one line: the reason for its place in the apply order.
        build: ``(model, options, run) -> handle or None``: attach the feature (None when its
            options leave it off, or when it cannot take effect: then it says why with
            ``run.note``). ``run`` is the :class:`~offloadkit.compose.OffloadRuntime` being
            built: its config, scheduler, ``step_timeline()`` and the handles built before.
        report: ``handle -> dict``: the keys this feature adds to ``runtime.report()``.
        remove: ``handle -> None``: detach it (``runtime.close()``, in reverse apply order);
            default ``handle.remove()``.
    """

    name: str
    options: type[Options]
    why_here: str
    build: Callable[[nn.Module, Any, OffloadRuntime], Any]
    report: Callable[[Any], dict] | None = None
    remove: Callable[[Any], None] = _remove
