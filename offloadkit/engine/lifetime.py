"""When an entry's memory goes: its device source, its resident copy, its host copy.

A device source is dropped once its copy to the host has landed (or the source's stream
waits for it); a resident copy once every handle sharing it was unpacked, or its pass ended;
the host copy when autograd releases the entry's last handle. Handles die on any thread and
only report to the :class:`~offloadkit.engine.spans.DeathQueue`; :meth:`Lifetime.drain`
processes them under the engine's lock, on every hook call.
"""

from __future__ import annotations

from offloadkit.engine.spans import Entry
from offloadkit.engine.state import EngineState
from offloadkit.transfer.completion import order_after

__all__ = ["Lifetime"]


class Lifetime:
    """The release of entries of one engine (``shared``); every method is called with
    ``shared.lock`` held."""

    def __init__(self, shared: EngineState) -> None:
        self.shared = shared

    def drain(self) -> None:
        dead = self.shared.dead
        while dead:
            entry, seen_gen = dead.popleft()
            self.handle_died(entry, seen_gen)

    def handle_died(self, entry: Entry, seen_gen: int) -> None:
        entry, _ = entry.resolve()
        unawaited, last = entry.handle_died(seen_gen)
        if unawaited:
            self.drop_resident(entry, consumed=False)
        if last:
            self.release(entry)

    def release(self, entry: Entry) -> None:
        if entry.released:
            return
        shared = self.shared
        entry.release()
        if entry.src is not None:
            try:
                shared.stash.remove(entry)
            except ValueError:
                pass
            self.drop_source(entry, wait=True)
        if entry.gpu is not None:
            self.drop_resident(entry, consumed=False)
        entry.stored.tier.free(entry.stored)
        shared.entries.discard(entry)
        sharers = shared.by_storage.get(entry.key)
        if sharers is not None:
            sharers.remove(entry)
            if not sharers:
                del shared.by_storage[entry.key]
        shared.planner.on_released(entry)
        step = entry.step
        if step is not None and step.live <= 0 and shared.passes.get(step.id) is step:
            shared.passes.pop(step.id, None)

    def drop_source(self, entry: Entry, wait: bool) -> None:
        if wait:
            # The side stream may still read the source: its memory must not be reused on the
            # source's stream until the copy is done (GPU-side wait, no host sync).
            self.shared.clock.wait(entry.src_stream, entry.stored.done, "forward", self.shared.stats)
        entry.drop_source()

    def drop_resident(self, entry: Entry, consumed: bool) -> None:
        if entry.prefetched:
            self.shared.lane.settle(entry.nbytes)  # fetched ahead and never used: it leaves the window
        guard = entry.gpu_guard
        if guard is not None and guard[1] is not None:
            if not consumed or guard[1] is not entry.gpu_ready:
                # Unconsumed prefetch: the copy may still write it. Stash source: the
                # device->host copy may still read it. Either way, order the reuse after it.
                order_after(guard[0], guard[1])
        entry.drop_resident()
