"""Moving bytes between host and device: the one place side streams are created and the one
copy choreography every client (the RAM and disk tiers, layer streaming, optimizer state)
queues through, the one prefetch scheduler that decides how far ahead each of them fetches,
and the one set of step hooks (:class:`StepTimeline`) that tells them where the step is.

A saved tensor's path runs hooks -> decide -> lifecycle -> storage (where bytes rest) ->
transfer (moving them); nothing here knows what the bytes are.
"""

from offloadkit.transfer.completion import FutureCompletion, order_after
from offloadkit.transfer.copy import queue_copy
from offloadkit.transfer.prefetch import Ahead, Lane, PrefetchScheduler, Status
from offloadkit.transfer.streams import copy_stream, copy_streams_created
from offloadkit.transfer.timeline import StepTimeline, TimelineListener

__all__ = [
    "Ahead",
    "FutureCompletion",
    "Lane",
    "PrefetchScheduler",
    "Status",
    "StepTimeline",
    "TimelineListener",
    "copy_stream",
    "copy_streams_created",
    "order_after",
    "queue_copy",
]
