"""The copy streams of each device, for the whole process: one device->host, one host->device,
and one host->device queue for bulk copies that are needed later (optimizer state, fetched a
window ahead).

Every copy of every client goes through these streams, so each queue runs its copies in the
order they were queued, and a client that needs an order across clients gets it from that
queue or from events, never from owning a stream of its own. The bulk queue exists because
an optimizer state's copy in waits for the compute stream (its buffer comes from the compute
stream's pool): in the one host->device queue, a block input's prefetch queued behind it
waited for the compute work too, and the GPU then waited for the block input (6-19 ms of an
85 ms step through the Trainer, benchmarks/results/full-ft/reserved-h100-df4d55f). Streams
are created on first use (nothing at import).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["DIRECTIONS", "copy_stream", "copy_streams_created", "update_stream"]

DIRECTIONS = ("d2h", "h2d", "h2d_bulk")

_lock = threading.Lock()
_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_update_streams: dict[int, torch.cuda.Stream] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def copy_stream(device: torch.device | str, direction: str) -> torch.cuda.Stream:
    """The copy stream of ``device`` for ``direction`` (one of :data:`DIRECTIONS`).

    Args:
        device: a CUDA device.
        direction: ``"d2h"`` (offloading), ``"h2d"`` (bringing back, streaming in: copies
            the GPU waits for soon) or ``"h2d_bulk"`` (optimizer state fetched a window ahead,
            whose copies wait for the compute stream: kept out of the ``"h2d"`` queue).

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
    """How many copy streams this process has created (at most three per device)."""
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
