"""The state the engine's collaborators share, held once per manager.

:class:`~offloadkit.OffloadActivations` owns one :class:`EngineState` and hands it to its
forward path, its backward path and the lifetime of its entries
(:mod:`offloadkit.engine.forward`, :mod:`~offloadkit.engine.backward`,
:mod:`~offloadkit.engine.lifetime`), which keep no copy of what is here: a value the manager
replaces (``reset_stats`` gives a new ``stats``) is the one they read next. The manager's
attributes of the same names are :class:`Shared` views of these fields.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from offloadkit.engine.policy import OffloadPolicy
from offloadkit.engine.prefetch import PrefetchPlanner, Step
from offloadkit.engine.spans import DeathQueue, Entry
from offloadkit.engine.stats import OffloadStats, WaitClock
from offloadkit.storage.base import StorageTier
from offloadkit.storage.budget import HostMemoryBudget
from offloadkit.transfer.prefetch import Lane, PrefetchScheduler
from offloadkit.transfer.timeline import StepTimeline

__all__ = ["EngineState", "Shared"]

T = TypeVar("T")


@dataclass(eq=False)
class EngineState:
    """Settings, counters and the bookkeeping of entries, read and written under ``lock``
    (the per-thread forward state aside, which only its thread touches)."""

    policy: OffloadPolicy
    tier: StorageTier
    budget: HostMemoryBudget
    scheduler: PrefetchScheduler
    lane: Lane
    timeline: StepTimeline
    stats: OffloadStats
    clock: WaitClock
    prefetch: int
    prefetch_bytes: int | None
    max_fwd_stash_size: int
    lock: threading.RLock = field(default_factory=threading.RLock)
    dead: DeathQueue = field(default_factory=DeathQueue)  # (entry, seen_gen) from handles that died
    entries: set[Entry] = field(default_factory=set)
    by_storage: dict[int, list[Entry]] = field(default_factory=dict)
    planner: PrefetchPlanner = field(default_factory=PrefetchPlanner)
    stash: deque[Entry] = field(default_factory=deque)
    passes: dict[int, Step] = field(default_factory=dict)  # steps being consumed by a backward pass, by step id
    # Forward state is per thread: a forward in another thread (nn.DataParallel replicas,
    # user threads) has its own step, tail and excluded regions.
    local: threading.local = field(default_factory=threading.local)
    tensor_id: int = 0  # saves numbered so far (TRL's name); never reset
    saves: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)  # id -> handle
    closed: bool = False

    def thread(self):
        """This thread's forward state (made on its first use)."""
        local = self.local
        if not hasattr(local, "step"):
            local.step, local.tail, local.keep_depth, local.pushed, local.group = None, False, 0, [], None
            local.placed = None  # the planned place of the saves now being made ("gpu", "ram", "disk")
            local.saves = 0  # tensors packed on this thread
        return local

    def reset_forward(self) -> None:
        """A new forward on this thread: a new step, outside any excluded or placed region."""
        state = self.thread()
        state.step, state.tail, state.keep_depth, state.placed = None, False, 0, None


class Shared(Generic[T]):
    """A manager attribute that is a field of its :class:`EngineState` (``_shared``): reading
    and assigning it reads and assigns the field, so the collaborators see the same value."""

    def __init__(self, field_name: str | None = None) -> None:
        self.field = field_name

    def __set_name__(self, owner: type, name: str) -> None:
        if self.field is None:
            self.field = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Shared[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj._shared, self.field)

    def __set__(self, obj: Any, value: T) -> None:
        setattr(obj._shared, self.field, value)
