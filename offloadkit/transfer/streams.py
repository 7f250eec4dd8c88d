"""One device->host and one host->device copy stream per device, for the whole process.

Every copy of every client goes through these two streams, so the link's two directions are
each one queue: copies in one direction run in the order they were queued, and a client that
needs an order across clients gets it from that queue or from events, never from owning a
stream of its own. Streams are created on first use (nothing at import).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["DIRECTIONS", "copy_stream", "copy_streams_created", "update_stream"]

DIRECTIONS = ("d2h", "h2d")

_lock = threading.Lock()
_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_update_streams: dict[int, torch.cuda.Stream] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def copy_stream(device: torch.device | str, direction: str) -> torch.cuda.Stream:
    """The copy stream of ``device`` for ``direction`` (``"d2h"`` or ``"h2d"``).

    Args:
        device: a CUDA device.
        direction: ``"d2h"`` (offloading) or ``"h2d"`` (bringing back, streaming in).

    Returns:
        The process's stream for that device and direction, created on first use.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} is not one of {DIRECTIONS}")
    key = (_index(torch.device(device)), direction)
    stream = _streams.get(key)
    if stream is None:
        with _lock:
            stream = _streams.get(key)
            if stream is None:
                stream = _streams[key] = torch.cuda.Stream(device=key[0])
    return stream


def copy_streams_created() -> int:
    """How many copy streams this process has created (at most two per device)."""
    return len(_streams)


def update_stream(device: torch.device | str) -> torch.cuda.Stream:
    """The stream of ``device`` on which optimizer updates wait for a gradient all-reduce
    (DDP's), so that the compute stream goes on with backward meanwhile. Not a copy stream:
    the updates' own state copies still go through :func:`copy_stream`."""
    index = _index(torch.device(device))
    with _lock:
        if index not in _update_streams:
            _update_streams[index] = torch.cuda.Stream(device=index)
        return _update_streams[index]
