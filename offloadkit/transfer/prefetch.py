"""The one prefetch scheduler: how far ahead of need bytes come back to the device, for every
client (saved activations, streamed layer weights, optimizer state), with one look-ahead rule
and one byte window per scheduler.

A client is a :class:`Lane`. It knows the order in which it will need its items (its
``upcoming`` walk, in need order) and how to queue one item's copy (its ``fetch``); the
scheduler decides which of them to queue now:

* look-ahead: keep ``groups`` groups ahead (a checkpointed block's inputs, one layer's
  weights) and at least ``min_bytes`` bytes, never more than the lane's ``max_bytes``;
* the shared window: the bytes fetched ahead and not yet used, over every lane of the
  scheduler, stay under ``window_bytes``. A lane that stops at the window walks again at its
  own next trigger (the next use of one of its items); the scheduler never calls into another
  client, so no client's lock is taken from inside another's.

Bytes "ahead" are those a lane fetched before they were needed and that still sit on the
device unused; a lane reports them (:meth:`Lane.settle`) when their consumer reads them or
they are dropped, so the window counts what is really held. (Bytes a failed backward left
resident stay counted until its graph is released, as their memory stays held.)

A window smaller than one item plus what another lane keeps ahead serves the lanes in the
order they ask: one lane's large items (a layer's weights) can then leave no room for
another's (a block's inputs), which load on demand. Size it to the look-aheads it bounds.

Nothing here touches streams or memory: fetches are the clients' (through
:func:`~offloadkit.transfer.queue_copy`), so the scheduler is tested without a GPU.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

__all__ = ["Ahead", "Lane", "PrefetchScheduler", "Status"]


class Status(enum.Enum):
    """Where an upcoming item stands."""

    HERE = "here"  # on the device or on its way: counts toward the look-ahead
    FETCH = "fetch"  # needs a copy
    SKIP = "skip"  # cannot be fetched now (no state yet, being rewritten): not counted


# One upcoming item: (item, bytes, group or None, status). Items of one group are needed together.
Upcoming = Iterable[tuple[object, int, object, Status]]


@dataclass(frozen=True)
class Ahead:
    """How far ahead a lane keeps its items on their way.

    Args:
        groups: groups kept ahead (a group is one checkpointed block's inputs, one layer's
            weights; an item without a group is its own).
        min_bytes: keep going past ``groups`` until this many bytes are ahead.
        max_bytes: stop queuing once this many of the lane's bytes are ahead (the copies in
            flight are bounded by it plus one item).
    """

    groups: int = 0
    min_bytes: int = 0
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.groups < 0 or self.min_bytes < 0 or (self.max_bytes is not None and self.max_bytes < 0):
            raise ValueError(f"{self} is invalid: counts and byte sizes are >= 0")

    @property
    def enabled(self) -> bool:
        return self.groups > 0 or self.min_bytes > 0


class Lane:
    """One client of a :class:`PrefetchScheduler`.

    Args:
        scheduler: the scheduler the lane's look-ahead runs in.
        name: for stats and messages ("activations", "weights", "optimizer state").
        fetch: ``fetch(item)`` queues the copy of one item.
        ahead: the lane's look-ahead.
    """

    def __init__(self, scheduler: PrefetchScheduler, name: str, fetch: Callable[[object], None], ahead: Ahead) -> None:
        self.scheduler = scheduler
        self.name = name
        self.fetch = fetch
        self.ahead = ahead
        self.pending_bytes = 0  # fetched ahead, not yet used
        self.fetched = 0  # items queued by the scheduler, ever
        self.fetched_bytes = 0
        self.held_back = 0  # walks stopped by the shared window

    def settle(self, nbytes: int) -> None:
        """``nbytes`` this lane fetched ahead were used or dropped: they leave the window."""
        self.scheduler._settle(self, nbytes)

    def reset(self) -> None:
        """Everything this lane fetched ahead was released at once (its pass ended and dropped
        what it had not used)."""
        self.scheduler._settle(self, self.pending_bytes)

    def close(self) -> None:
        """Leave the scheduler's stats (the client was removed); bytes it still holds ahead stay
        counted until they are settled."""
        with self.scheduler._lock:
            self.scheduler._lanes.pop(self, None)


class PrefetchScheduler:
    """The look-ahead of every lane, under one byte window.

    Args:
        window_bytes: the most bytes fetched ahead and not yet used, over all lanes (None: each
            lane is bounded by its own :class:`Ahead` only).
    """

    def __init__(self, window_bytes: int | None = None) -> None:
        if window_bytes is not None and (isinstance(window_bytes, bool) or window_bytes < 1):
            raise ValueError(f"window_bytes={window_bytes!r} is invalid; use a byte count >= 1 or None (no window)")
        self.window_bytes = window_bytes
        self.pending_bytes = 0
        self.peak_pending_bytes = 0
        self._lanes: dict[Lane, str] = {}  # lane -> its name in stats(), unique
        self._lock = threading.RLock()

    def lane(self, name: str, fetch: Callable[[object], None], ahead: Ahead) -> Lane:
        """A new client of this scheduler (see :class:`Lane`)."""
        lane = Lane(self, name, fetch, ahead)
        with self._lock:
            taken = set(self._lanes.values())
            key, n = name, 1
            while key in taken:
                n += 1
                key = f"{name} #{n}"
            self._lanes[lane] = key
        return lane

    def prefetch(self, lane: Lane, upcoming: Upcoming, ahead: Ahead | None = None) -> int:
        """Queue the fetches ``lane``'s look-ahead and the window allow now.

        Args:
            lane: the client.
            upcoming: the lane's items in need order from its current position, walked lazily
                (only as far as the look-ahead goes).
            ahead: the look-ahead of this walk (default: the lane's).

        Returns:
            How many fetches were queued.
        """
        ahead = lane.ahead if ahead is None else ahead
        if not ahead.enabled:
            return 0
        with self._lock:
            return self._walk(lane, ahead, upcoming)

    def _walk(self, lane: Lane, ahead: Ahead, upcoming: Upcoming) -> int:
        groups = ahead_bytes = queued = 0
        last_group: object = _NO_GROUP
        for item, nbytes, group, status in upcoming:
            if status is Status.SKIP:
                continue
            if group is None or group != last_group:
                if groups >= ahead.groups and ahead_bytes >= ahead.min_bytes:
                    break
                groups += 1
                last_group = group
            if status is Status.FETCH:
                if ahead.max_bytes is not None and lane.pending_bytes >= ahead.max_bytes:
                    break
                window = self.window_bytes
                if window is not None and self.pending_bytes and self.pending_bytes + nbytes > window:
                    lane.held_back += 1
                    break
                lane.fetch(item)
                queued += 1
                lane.fetched += 1
                lane.fetched_bytes += nbytes
                lane.pending_bytes += nbytes
                self.pending_bytes += nbytes
                self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)
            ahead_bytes += nbytes
        return queued

    def _settle(self, lane: Lane, nbytes: int) -> None:
        with self._lock:
            nbytes = min(nbytes, lane.pending_bytes)
            if nbytes <= 0:
                return
            lane.pending_bytes -= nbytes
            self.pending_bytes -= nbytes

    def stats(self) -> dict[str, dict[str, int]]:
        """Per lane (open lanes; a second lane of one name is "name #2"): items and bytes
        fetched ahead, walks held back by the window, bytes ahead now."""
        with self._lock:
            return {
                key: {
                    "fetched": lane.fetched,
                    "fetched_bytes": lane.fetched_bytes,
                    "held_back": lane.held_back,
                    "pending_bytes": lane.pending_bytes,
                }
                for lane, key in self._lanes.items()
            }


_NO_GROUP = object()
