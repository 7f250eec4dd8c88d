"""The copy choreography, written once: order after the producer, order after earlier copies
of the same host block, queue the copy, record its completion, note it on the block.

Why each step:

1. ``after``: the copy's stream waits for the point where its inputs exist (the compute
   stream that produced a source, or the event recorded where a destination was allocated,
   whose memory may have been released by compute work queued before it).
2. ``block.order_device_use``: a pooled host block may still be read or written by an earlier
   copy on the other direction's stream (bytes offloaded are read back only once they landed;
   a recycled block is not overwritten while a copy still reads it).
3. the copy itself, asynchronous when the block is pinned.
4. ``record_event``: the copy's completion, which consumers on other streams wait on and
   which the block remembers (step 2 of the next copy that touches it).

With ``stream`` equal to the compute stream (the plain ``legacy`` mode) the same steps run,
and stream order alone makes them safe.
"""

from __future__ import annotations

import torch

__all__ = ["queue_copy"]


def queue_copy(
    dst: torch.Tensor,
    src: torch.Tensor,
    *,
    stream: torch.cuda.Stream,
    block,
    after: torch.cuda.Stream | torch.cuda.Event | None,
) -> torch.cuda.Event:
    """Queue ``dst.copy_(src)`` on ``stream``, one side of it in the host ``block``.

    Args:
        dst, src: byte views; one on the device, one in ``block``.
        stream: the copy stream of the direction (or the compute stream, without overlap).
        block: the :class:`~offloadkit.storage.pool.HostBlock` holding the host side.
        after: what the copy must follow: a stream (its work queued so far) or an event;
            None when the caller has ordered it already.

    Returns:
        The event recorded on ``stream`` once the copy is done.
    """
    with torch.cuda.device(stream.device):
        if isinstance(after, torch.cuda.Event):
            stream.wait_event(after)
        elif after is not None and after != stream:
            stream.wait_stream(after)
        block.order_device_use(stream)
        with torch.cuda.stream(stream):
            _enqueue(dst, src, block.pinned)
        done = stream.record_event()
    block.note_use(stream, done)
    return done


def _enqueue(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """The copy on the current stream (the one function every device copy goes through)."""
    dst.copy_(src, non_blocking=non_blocking)
