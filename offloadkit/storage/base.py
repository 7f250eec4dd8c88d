"""What every storage tier hands back to the engine.

A tier moves a contiguous byte range (a ``uint8`` view of a device storage span) off
the device and brings it back. The engine owns *what* to move and *when*; tiers own
*how* and *where*.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from offloadkit.transfer.completion import FutureCompletion, order_after

__all__ = ["FutureCompletion", "Stored", "Loaded", "StorageTier", "order_after"]


@dataclass(eq=False)
class Stored:
    """Bytes that left the device.

    ``done`` is an event on ``done_stream`` that completes when the source bytes have
    been read (None: already complete); until then the device source must stay alive.
    """

    tier: "StorageTier"
    nbytes: int
    device: torch.device
    done: Any = None
    done_stream: Any = None
    payload: Any = field(default=None, repr=False)  # tier-private (host block, file extent, ...)

    def copy_finished(self) -> bool:
        return self.done is None or self.done.query()


@dataclass(eq=False)
class Loaded:
    """Bytes brought back to the device.

    ``data`` (uint8) is valid once ``ready`` has completed (None: already valid).
    ``alloc_stream`` is the stream ``data`` was allocated on: work on any other stream
    that uses it must be recorded against it before it is freed.
    """

    data: torch.Tensor
    ready: Any = None
    alloc_stream: Any = None


@runtime_checkable
class StorageTier(Protocol):
    """What the engine and the report need of a tier; nothing else is looked up by name."""

    name: str
    pools: tuple  # the HostBufferPools holding this tier's host memory (primary first)
    default_prefetch: int  # entries to fetch ahead in backward when the user sets none

    def store(self, src: torch.Tensor, where: str | None = None) -> Stored | None:
        """Start moving ``src`` (uint8, 1-D) off the device; None if this tier has no room.
        ``where`` ("ram" or "disk") is a planned place: a tier with both honours it, a tier
        with one place has no choice to make."""

    def load(self, stored: Stored) -> Loaded:
        """Start bringing ``stored`` back to its device, ordered after the current stream."""

    def free(self, stored: Stored) -> None:
        """Give the space behind ``stored`` back (it will not be loaded again)."""

    def host_bytes(self) -> int:
        """Host RAM held (pinned buffers, staging), in use or idle."""

    def host_bytes_in_use(self) -> int:
        """Host RAM holding offloaded data (or data on its way to disk) now."""

    def bytes_on_disk(self) -> int:
        """Bytes of offloaded data on disk now (0 for tiers without files)."""

    def stats_dict(self) -> dict:
        """Tier counters keyed by tier name (``{"disk": {...}}``); empty when there are none."""

    def reset_stats(self) -> None:
        """Start the counters of :meth:`stats_dict` again (after warm-up steps, say)."""

    def close(self) -> None: ...
