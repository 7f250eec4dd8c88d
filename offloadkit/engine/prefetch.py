"""In which order backward will need offloaded entries, per graph.

Every forward that saves tensors opens a :class:`Step` (its graph's entries, in save
order). A backward pass consumes one step. The first backward of a model assumes the
reverse of the order in which entries were last saved. That is close but not exact: one
autograd node may unpack several saved tensors in its own field order (attention unpacks
q, k, v, out, ...), and parallel branches interleave. So every pass that consumes a whole
step records the order in which its entries were really used; the next step with the same
number of entries replays it, also when its sizes differ (variable-length batches save
the same tensors at other lengths). Outputs kept for a checkpoint's recompute are entries
too, but fetched as that recompute begins: the order names saved tensors' entries only, by
rank, so steps that keep more or fewer outputs share it. The order is only a hint: a wrong
guess costs a wait, never a wrong result.

Everything is tied to the step it came from, so a partial ``autograd.grad`` on an older
retained graph, or two threads sharing one manager, never mix their bookkeeping.
"""

from __future__ import annotations

import itertools

from offloadkit.engine.spans import BackwardOrder, Entry

__all__ = ["PrefetchPlanner", "Step"]

_step_ids = itertools.count()


class Step:
    """The offloaded entries of one forward (one graph), in save order."""

    __slots__ = (
        "id",
        "order",
        "by_seq",
        "next_seq",
        "live",
        "passes",
        "task",
        "cursor",
        "plan",
        "trace",
        "consumed",
        "window_bytes",
        "outputs",
    )

    def __init__(self) -> None:
        self.id = next(_step_ids)
        self.order = BackwardOrder()
        self.by_seq: dict[int, Entry] = {}
        self.next_seq = 0
        self.live = 0  # entries not yet released
        self.passes = 0  # backward passes started on it
        self.task: int | None = None  # graph task consuming it now
        self.cursor = 0
        self.plan: list[int] | None = None  # the learned order, when it fits this step
        self.trace: list[int] = []  # seqs in consumption order during the current pass
        self.consumed: set[int] = set()  # seqs used in the current pass
        self.window_bytes = 0
        self.outputs: set[int] = set()  # seqs of entries holding only outputs kept for a recompute


def _saved_seqs(step: Step) -> list[int]:
    """The seqs of ``step``'s saved tensors' entries (not kept outputs'), in save order."""
    return [seq for seq in range(step.next_seq) if seq not in step.outputs]


class PrefetchPlanner:
    """Tracks save order per step, records consumption order, proposes what to fetch next."""

    def __init__(self) -> None:
        # Learned from the last pass that used a whole step: the order of use of its saved
        # tensors' entries, each by its rank among them in save order.
        self._plan: list[int] | None = None

    # -- forward -----------------------------------------------------------------------
    @staticmethod
    def on_saved(step: Step, entry: Entry, new: bool) -> None:
        if new:
            entry.place(step, step.next_seq)
            step.next_seq += 1
            step.by_seq[entry.seq] = entry
            step.live += 1
        step.order.push(entry)

    @staticmethod
    def on_released(entry: Entry) -> None:
        step = entry.step
        if step is None:
            return
        step.order.remove(entry)
        if step.by_seq.get(entry.seq) is entry:
            del step.by_seq[entry.seq]
            step.live -= 1
        if step.live <= 0:
            step.order.clear()

    # -- backward ----------------------------------------------------------------------
    def begin_pass(self, step: Step, task: int | None) -> bool:
        """Start consuming ``step``; returns True when this pass replays the learned order."""
        step.task = task
        step.passes += 1
        step.cursor = 0
        step.trace = []
        step.consumed = set()
        plan = self._plan
        # Outputs kept for a recompute are fetched as it begins, not by the learned order,
        # which names saved tensors' entries by their rank among them: a step matches it when
        # its saved tensors' entries do, however many outputs it kept (a kernel run again
        # leaves its outputs unused; outputs refused by storage get no entry).
        saved = _saved_seqs(step)
        alive = sum(1 for e in step.by_seq.values() if not e.for_recompute)
        ok = plan is not None and len(plan) == len(saved) == alive
        step.plan = [saved[rank] for rank in plan] if ok and plan is not None else None
        return ok

    @staticmethod
    def on_consumed(step: Step, entry: Entry) -> bool:
        """Record the first use of ``entry`` in this pass; False if it was already used."""
        if entry.seq in step.consumed:
            return False
        step.consumed.add(entry.seq)
        if not entry.for_recompute:
            step.trace.append(entry.seq)
        return True

    def end_pass(self, step: Step) -> None:
        # Learn only from a pass that used every entry of its forward exactly once.
        saved = _saved_seqs(step)
        if step.trace and len(step.trace) == len(saved):
            rank = {seq: i for i, seq in enumerate(saved)}
            self._plan = [rank[seq] for seq in step.trace]
        step.trace = []
        step.plan = None
        step.task = None

    @staticmethod
    def upcoming(step: Step, current: Entry | None):
        """Entries of ``step`` in the order backward should need them next, skipping used ones."""
        consumed = step.consumed
        if step.plan is not None:
            plan, by_seq = step.plan, step.by_seq
            while step.cursor < len(plan):  # slide past the consumed front
                e = by_seq.get(plan[step.cursor])
                if e is None or e.released or e.seq in consumed:
                    step.cursor += 1
                else:
                    break
            for i in range(step.cursor, len(plan)):
                e = by_seq.get(plan[i])
                if e is not None and not e.released and e.seq not in consumed and e is not current:
                    yield e
            return
        pos = len(step.order) if current is None or current.step is not step else current.pos
        for e in step.order.below(pos):
            if e.seq not in consumed:
                yield e
