"""In which order backward will need offloaded entries.

The first backward of a model assumes the reverse of the order in which entries were
last saved. That is close but not exact: one autograd node may unpack several saved
tensors in its own field order (attention unpacks q, k, v, out, ...), and parallel
branches interleave. So every backward also records the order in which entries were
really consumed; when the next step's forward creates the same entries (same count and
sizes, the usual case for a training loop), backward replays that recorded order.
The order is only a hint: a wrong guess costs a wait, never a wrong result.
"""

from __future__ import annotations

from offloadkit.engine.spans import BackwardOrder, Entry

__all__ = ["PrefetchPlanner"]


class PrefetchPlanner:
    """Tracks save order, records consumption order, and proposes what to fetch next."""

    def __init__(self) -> None:
        self.order = BackwardOrder()
        self._by_seq: dict[int, Entry] = {}
        self._next_seq = 0
        self._trace: list[tuple[int, int]] = []  # (seq, nbytes) in consumption order
        self._plan: list[int] | None = None
        self._plan_sizes: list[int] | None = None
        self._active: list[int] | None = None  # the plan, when it matches this step
        self._cursor = 0

    # -- forward -----------------------------------------------------------------------
    def new_step(self) -> None:
        """Entries created from now on belong to a new forward."""
        self._by_seq.clear()
        self._next_seq = 0

    def on_saved(self, entry: Entry, new: bool) -> None:
        if new:
            entry.seq = self._next_seq
            self._next_seq += 1
            self._by_seq[entry.seq] = entry
        self.order.push(entry)

    def on_released(self, entry: Entry) -> None:
        self.order.remove(entry)
        if self._by_seq.get(entry.seq) is entry:
            del self._by_seq[entry.seq]

    # -- backward ----------------------------------------------------------------------
    def begin_pass(self) -> bool:
        """Start recording; returns True when this pass replays the learned order."""
        self._trace = []
        self._cursor = 0
        plan = self._plan
        ok = (
            plan is not None
            and len(plan) == self._next_seq == len(self._by_seq)
            and all(self._by_seq[s].nbytes == n for s, n in zip(plan, self._plan_sizes))
        )
        self._active = plan if ok else None
        return ok

    def on_consumed(self, entry: Entry) -> None:
        """First use of ``entry`` in this backward pass."""
        self._trace.append((entry.seq, entry.nbytes))

    def end_pass(self) -> None:
        # Learn only from a pass that used every entry of its forward exactly once.
        seqs = [s for s, _ in self._trace]
        if seqs and len(seqs) == len(set(seqs)) == self._next_seq:
            self._plan, self._plan_sizes = seqs, [n for _, n in self._trace]
        self._trace = []
        self._active = None

    def upcoming(self, current: Entry | None, consumed):
        """Entries in the order backward should need them next, skipping consumed ones.

        ``consumed(entry)`` tells whether an entry was already used in this pass.
        """
        if self._active is not None:
            plan, by_seq = self._active, self._by_seq
            while self._cursor < len(plan):  # slide past the consumed front
                e = by_seq.get(plan[self._cursor])
                if e is None or e.released or consumed(e):
                    self._cursor += 1
                else:
                    break
            for i in range(self._cursor, len(plan)):
                e = by_seq.get(plan[i])
                if e is not None and not e.released and not consumed(e) and e is not current:
                    yield e
            return
        pos = len(self.order) if current is None else current.pos
        for e in self.order.below(pos):
            if not consumed(e):
                yield e

    def reset(self) -> None:
        if not self._by_seq:
            self.order.clear()
