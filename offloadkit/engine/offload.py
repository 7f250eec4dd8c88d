"""The activation offloading engine: a ``saved_tensors_hooks`` context manager.

This module holds the manager: its context-manager and public API, the per-thread
forward regions, and the hooks it hands to autograd. The work is done by collaborators
sharing one :class:`~offloadkit.engine.state.EngineState`: the forward path (pack, stash:
:mod:`offloadkit.engine.forward`), the backward path (passes, prefetch, residency:
:mod:`offloadkit.engine.backward`), the lifetime of entries (a handle autograd releases, a
closed manager: :mod:`offloadkit.engine.lifetime`) and the hooks' pushing on other threads
(:mod:`offloadkit.engine.threads`). Which tensors move is
:mod:`offloadkit.engine.policy`, in which order they come back :mod:`offloadkit.engine.prefetch`.
The host copy of an entry is freed when autograd releases its last handle.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks

from offloadkit.defaults import MAX_FWD_STASH_SIZE, MIN_OFFLOAD_SIZE
from offloadkit.engine.backward import BackwardPath
from offloadkit.engine.decide import PLACES
from offloadkit.engine.forward import ForwardPath
from offloadkit.engine.lifetime import Lifetime
from offloadkit.engine.policy import OffloadPolicy
from offloadkit.engine.prefetch import Step
from offloadkit.engine.spans import Entry, Kept, Packed
from offloadkit.engine.state import EngineState, Shared
from offloadkit.engine.stats import OffloadStats, WaitClock
from offloadkit.engine.threads import FollowThreads
from offloadkit.engine.validation import check_args
from offloadkit.runtime.autograd import (
    pop_saved_tensor_hooks,
    push_saved_tensor_hooks,
)
from offloadkit.runtime.device import accelerator_available
from offloadkit.storage.base import StorageTier
from offloadkit.storage.budget import HostMemoryBudget
from offloadkit.storage.factory import build_tier
from offloadkit.transfer.prefetch import Ahead, PrefetchScheduler
from offloadkit.transfer.timeline import StepTimeline, TimelineListener

__all__ = ["OffloadActivations"]

_warned_no_accelerator = False


class OffloadActivations(saved_tensors_hooks, contextlib.ContextDecorator):
    """Offload tensors saved for backward to host memory; bring them back ahead of need.

    Args:
        use_pin_memory: page-lock host buffers (needed for asynchronous copies).
        use_streams: overlap copies with compute on a side stream. ``False`` is the
            ``legacy`` mode: copies are queued on the current stream.
        min_offload_size: smallest tensor (bytes) worth moving.
        max_fwd_stash_size: device sources kept alive while their copies are in flight
            during forward (>= 1). Past it the compute stream waits for the oldest copy.
        prefetch: entries brought back ahead of the one in use during backward
            (``activation_loading_horizon``), >= 0; 0 disables prefetching. ``None``: the
            tier's default, 2 for RAM and 4 for disk storage, whose reads take longer.
        prefetch_bytes: also keep at least this many bytes in flight ahead. Without
            checkpointing, entries range from KiB to hundreds of MiB and a count alone
            leaves the copy engine idle. ``None`` (default): 1/16 of the bytes the step
            offloaded that the look-ahead brings back (not kept attention outputs, which
            come back with their block's recompute), so the window costs at most ~6% of
            what offloading saves (a 1B
            model at 16K tokens on an H200: 1.19 s -> 1.085 s per step with a 1-4 GiB
            window). 0: count only.
        host_budget_bytes: cap on host bytes held; past it tensors stay on the device
            with one warning. ``None``: no cap beyond keeping ``budget.min_free_bytes``
            of system RAM available.
        budget: a shared :class:`HostMemoryBudget` (overrides ``host_budget_bytes``).
        storage: ``"ram"`` (pinned host RAM; past the budget tensors stay on the device),
            ``"disk"`` (files, staged through host buffers) or ``"tiered"`` (RAM up to
            the budget, the oldest entries moved to disk past it).
        disk: :class:`~offloadkit.storage.DiskOptions` for the disk and tiered storage.
        tier: a ready storage tier (overrides ``storage``).
        offload_cpu_tensors: also offload CPU tensors (to separate host buffers or disk);
            this is how CPU-only runs exercise the engine.
        measure_waits: time the compute stream's waits with device events.
        scheduler: the :class:`~offloadkit.transfer.PrefetchScheduler` whose window the
            look-ahead runs in, shared with layer streaming and optimizer state
            (:func:`~offloadkit.prepare` passes one); None: one of its own.
        timeline: the :class:`~offloadkit.transfer.StepTimeline` that reports the ends of
            backward (and, wired by :func:`~offloadkit.get_act_offloading_ctx_manager`, the
            step's forward and head); shared with layer streaming. None: one of its own.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU())
        >>> manager = OffloadActivations(offload_cpu_tensors=True)
        >>> with manager:
        ...     loss = model(torch.randn(64, 512)).sum()
        >>> loss.backward()
        >>> manager.stats.offloaded_tensors > 0
        True
    """

    # Fields of the engine state (``_shared``), which the collaborators read and write.
    policy = Shared[OffloadPolicy]()
    tier = Shared[StorageTier]()
    budget = Shared[HostMemoryBudget]()
    scheduler = Shared[PrefetchScheduler]()
    timeline = Shared[StepTimeline]()
    stats = Shared[OffloadStats]()
    prefetch = Shared[int]()
    prefetch_bytes = Shared[int | None]()
    max_fwd_stash_size = Shared[int]()
    tensor_id = Shared[int]()  # saves numbered so far (TRL's name); never reset
    _entries = Shared[set[Entry]]("entries")
    _passes = Shared[dict[int, Step]]("passes")

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_size: int = MIN_OFFLOAD_SIZE,
        max_fwd_stash_size: int = MAX_FWD_STASH_SIZE,
        *,
        prefetch: int | None = None,
        prefetch_bytes: int | None = None,
        host_budget_bytes: int | None = None,
        budget: HostMemoryBudget | None = None,
        storage: str = "ram",
        disk=None,
        tier=None,
        offload_cpu_tensors: bool = False,
        measure_waits: bool = True,
        scheduler: PrefetchScheduler | None = None,
        timeline: StepTimeline | None = None,
    ) -> None:
        check_args(
            use_pin_memory=use_pin_memory,
            use_streams=use_streams,
            max_fwd_stash_size=max_fwd_stash_size,
            prefetch=prefetch,
            prefetch_bytes=prefetch_bytes,
            host_budget_bytes=host_budget_bytes,
            storage=storage,
            disk=disk,
            offload_cpu_tensors=offload_cpu_tensors,
            budget=budget,
            tier=tier,
            measure_waits=measure_waits,
        )
        if scheduler is not None and not isinstance(scheduler, PrefetchScheduler):
            raise ValueError(f"scheduler={scheduler!r} is invalid; pass a transfer.PrefetchScheduler or None")
        device_types = ("cuda", "cpu") if offload_cpu_tensors else ("cuda",)
        policy = OffloadPolicy(min_offload_size, device_types)
        self.use_streams = bool(use_streams)
        self.use_pin_memory = bool(use_pin_memory)
        self._window_bytes = prefetch_bytes or 0  # resolved per backward pass when None
        self.offload_cpu_tensors = bool(offload_cpu_tensors)
        self._check_accelerator()

        budget = budget if budget is not None else HostMemoryBudget(host_budget_bytes)
        pin = self.use_pin_memory and accelerator_available()
        if tier is None:
            tier = build_tier(storage, budget, pin_memory=pin, use_streams=self.use_streams, disk=disk)
        prefetch = tier.default_prefetch if prefetch is None else prefetch
        scheduler = scheduler if scheduler is not None else PrefetchScheduler()
        lane = scheduler.lane("activations", self._fetch_ahead, Ahead(groups=prefetch))
        if timeline is not None and not isinstance(timeline, StepTimeline):
            raise ValueError(f"timeline={timeline!r} is invalid; pass a transfer.StepTimeline or None")
        # Where backward passes end (and, once wired to a model, where the step is): a bare
        # manager's own timeline hooks nothing and only reports the ends of backward.
        timeline = timeline if timeline is not None else StepTimeline()
        # Kept past close(): a graph saved before it may still be in backward.
        timeline.subscribe(_PassEnds(self))
        self._shared = EngineState(
            policy=policy,
            tier=tier,
            budget=budget,
            scheduler=scheduler,
            lane=lane,
            timeline=timeline,
            stats=OffloadStats(),
            clock=WaitClock(measure_waits and accelerator_available()),
            prefetch=prefetch,
            prefetch_bytes=prefetch_bytes,
            max_fwd_stash_size=max_fwd_stash_size,
        )
        self._lifetime = Lifetime(self._shared)
        self._forward = ForwardPath(self._shared, self._lifetime)
        self._backward = BackwardPath(self._shared, self._lifetime)

        # The hooks autograd, other threads and the scheduler call are this manager's methods:
        # a live graph (or lane) keeps the manager itself alive.
        self._threads = FollowThreads(self._shared, self._pack, self._unpack)
        self._groups = itertools.count()
        self._handles: list = []  # module hooks attached on this manager's behalf
        super().__init__(self._pack, self._unpack)

    # -- hooks, delegated to the collaborators ------------------------------------------------
    def _pack(self, t: torch.Tensor):
        return self._forward.pack(t)

    def _unpack(self, packed):
        return self._backward.unpack(packed)

    def _fetch_ahead(self, entry) -> None:
        self._backward.fetch_ahead(entry)

    # -- context manager -------------------------------------------------------------------
    def __enter__(self):
        if self._shared.closed:
            raise RuntimeError("this OffloadActivations was closed; create a new one")
        with self._shared.lock:
            self._lifetime.drain()
            self.policy.refresh()
            self._reset_forward()
            # Saved-tensor hooks are per thread: while the region is open, module forwards on
            # other threads (nn.DataParallel replicas, workers) get them pushed.
            self._threads.open()
        super().__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        super().__exit__(exc_type, exc, tb)
        with self._shared.lock:
            self._threads.close()
            state = self._state()
            state.tail, state.keep_depth, state.placed = False, 0, None
            if exc_type is not None:
                # The graph of a failed forward is about to be dropped; do not pin device memory for it.
                self._forward.flush_stash()
            self._lifetime.drain()
        return False

    @property
    def _follow(self) -> tuple:
        """The process-wide module hooks of an open region (empty once it is closed)."""
        return self._threads.hooks

    # -- per-thread forward state -------------------------------------------------------------
    def _state(self):
        return self._shared.thread()

    def _reset_forward(self) -> None:
        self._shared.reset_forward()

    def current_step(self) -> Step | None:
        """The step (graph) this thread's forward is saving into, if any."""
        return self._state().step

    # -- public API --------------------------------------------------------------------------
    def track(self, module: torch.nn.Module) -> None:
        """Never offload ``module``'s parameter/buffer storage (recognised by storage)."""
        self.policy.track(module)

    def add_hook_handle(self, handle) -> None:
        """Keep a removable handle so :meth:`remove` detaches it with this manager."""
        self._handles.append(handle)

    def keep_enter(self) -> None:
        """Start a region whose saved tensors stay on the device (see :meth:`exclude`)."""
        self._state().keep_depth += 1

    def keep_exit(self) -> None:
        state = self._state()
        state.keep_depth = max(0, state.keep_depth - 1)

    @contextlib.contextmanager
    def placed(self, where: str | None):
        """Saves made in the ``with`` body go to ``where``: "gpu" (kept), "ram" or "disk" (a
        planned place the storage tier honours), or None (the tier's own choice). Used around
        a checkpointed block's inputs when a plan placed them."""
        if where not in (None, *PLACES):
            raise ValueError(f"where={where!r} is not a place; use one of {PLACES} or None")
        state = self._state()
        previous, state.placed = state.placed, where
        try:
            yield self
        finally:
            state.placed = previous

    # Outputs of a checkpointed block's forward that its recompute takes instead of computing
    # them again (checkpointing/attention.py): held as saved tensors are (None: not kept),
    # brought back as the recompute begins, restored there (None: written since; recompute).
    def save_for_recompute(self, t: torch.Tensor) -> Packed | Kept | None:
        return self._forward.save_output(t)

    def fetch_for_recompute(self, handles) -> None:
        self._backward.fetch_outputs(handles)

    def restore_for_recompute(self, handle: Packed | Kept) -> torch.Tensor | None:
        return self._backward.restore_output(handle)

    def update_model_params(self, model: torch.nn.Module) -> None:
        """Never offload ``model``'s parameters (re-read now; call again after they change).

        The name TRL's engine gives this; :meth:`track` does the same.
        """
        self.track(model)

    @property
    def param_storages(self) -> set[int]:
        """Data pointers of the parameter and buffer storages that are never offloaded."""
        return self.policy.storage_pointers()

    @property
    def tracker(self) -> dict[int, tuple]:
        """Saves autograd still holds, by id: ``(tensor, offloaded, stride, storage_offset, shape)``.

        The view TRL's engine offers under this name, read-only. ``offloaded`` is True for the
        save that started a copy; kept saves (``tensor`` is the device tensor) and saves served
        by an earlier save's copy (``tensor`` is None) are False. Emptied as autograd releases
        its handles after backward.
        """
        return self._forward.tracker()

    @property
    def storage_to_tensor_id(self) -> dict[int, int]:
        """For each storage range copied and still held: the id of the save that copied it (TRL's name)."""
        return self._forward.storage_to_tensor_id()

    def exclude(self, module: torch.nn.Module) -> None:
        """Keep everything ``module`` saves on the device. Detached by :meth:`remove`."""
        self._handles.append(module.register_forward_pre_hook(lambda *_: self.keep_enter()))
        self._handles.append(module.register_forward_hook(lambda *_: self.keep_exit(), always_call=True))

    def mark_forward_start(self) -> None:
        """A new forward begins (called by a root-module pre-hook): a new step."""
        self._reset_forward()

    def forward_pre_hook(self, module, args) -> None:
        """Root-module pre-hook: a new step (see :meth:`thread_pre_hook` for other threads)."""
        self._reset_forward()
        self.thread_pre_hook(module, args)

    def thread_pre_hook(self, module, args) -> None:
        """A forward that runs on another thread than the one that entered the context
        (``nn.DataParallel`` replicas, user threads) gets the hooks pushed for its duration,
        since saved-tensor hooks are per thread: the outermost module forward on that thread
        pushes, its end pops.

        Module forwards inside a backward are left alone: they are checkpointing's
        recomputation (on CUDA, on the engine's device thread), whose saves its own hooks
        must see."""
        self._threads.pre_hook(module, args)

    def forward_post_hook(self, module, args, output) -> None:
        """Module post-hook: pops the hooks :meth:`thread_pre_hook` pushed for this forward."""
        self._threads.post_hook(module, args, output)

    def flush(self) -> None:
        """Let go of every device source whose copy is in flight (GPU-side waits only).

        Called before the output head so that the large logits allocation does not stack
        on top of activations still being copied.
        """
        with self._shared.lock:
            self._forward.flush_stash()

    def mark_tail(self) -> None:
        """Keep everything saved in the rest of this forward on the GPU: called once the
        output head has run, or after the last checkpointed block.

        What follows (the final norm, the head, the loss over full-vocabulary logits) is
        needed first in backward; offloading it only to fetch it straight back costs time and
        saves nothing at the peak.
        """
        with self._shared.lock:
            self._state().tail = True
            self._forward.flush_stash()

    def begin_backward(self, step: Step | None) -> None:
        """Backward reached a known point of ``step``'s graph (the head, a block's output):
        start its pass if it has not started, and top the prefetch window up."""
        if step is None:
            return
        with self._shared.lock:
            self._lifetime.drain()
            if step.live <= 0:
                return
            self._backward.pass_for(step)
            self._backward.look_ahead(step, None)

    @contextlib.contextmanager
    def capture(self):
        """Route saved tensors through this manager for a short region, without the
        per-step work of ``__enter__`` (used around each checkpointed block's inputs, which
        form one group: backward needs them together)."""
        state = self._state()
        previous, state.group = state.group, next(self._groups)
        push_saved_tensor_hooks(self._pack, self._unpack)
        try:
            yield self
        finally:
            pop_saved_tensor_hooks()
            state.group = previous

    def remove(self) -> None:
        """Detach every module hook this manager attached."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def close(self) -> None:
        """Detach hooks and release the host pool (buffers still in use go as they are freed)."""
        if self._shared.closed:
            return
        self.remove()
        with self._shared.lock:
            self._forward.flush_stash()
            self._lifetime.drain()
            self._shared.closed = True
            # Graphs still alive keep their host copies; when autograd drops them, give them back.
            self._shared.dead.close(self._death_after_close)
        self.tier.close()
        self.policy.untrack_all()
        self._shared.lane.close()

    def _death_after_close(self, entry: Entry, seen_gen: int) -> None:
        with self._shared.lock:
            self._lifetime.handle_died(entry, seen_gen)

    def drain(self) -> None:
        """Process handles autograd has released (done automatically on every hook call)."""
        with self._shared.lock:
            self._lifetime.drain()
            self._shared.clock.collect(self.stats)

    def is_idle(self) -> bool:
        """True when nothing is held for any graph: no entries, no stash, no resident copies."""
        with self._shared.lock:
            self._lifetime.drain()
            shared = self._shared
            return not shared.entries and not shared.stash and not shared.by_storage

    @property
    def live_entries(self) -> int:
        with self._shared.lock:
            self._lifetime.drain()
            return len(self._shared.entries)

    def collect_stats(self, block: bool = True) -> OffloadStats:
        """Stats with all wait timings resolved (``block`` synchronises pending timers)."""
        with self._shared.lock:
            self._shared.clock.collect(self.stats, block=block)
            return self.stats

    def reset_stats(self) -> None:
        """Start every counter again: the engine's and its storage tier's, so that both
        count the same steps."""
        with self._shared.lock:
            self._shared.clock.collect(self.stats, block=True)
            self.stats = OffloadStats()
            self.tier.reset_stats()

    @property
    def pool(self):
        """The tier's primary host pool (pinned RAM, or disk staging)."""
        return self.tier.pools[0]

    def host_bytes(self) -> int:
        """Host RAM held by the storage tier (in use or cached)."""
        return self.tier.host_bytes()

    def storage_stats(self) -> dict:
        """Counters of the storage tier(s): bytes written/read and bandwidth for disk, demotions."""
        return {"tier": self.tier.name, "host_bytes": self.tier.host_bytes(), **self.tier.stats_dict()}

    def _check_accelerator(self) -> None:
        global _warned_no_accelerator
        if accelerator_available() or self.offload_cpu_tensors:
            return
        if not _warned_no_accelerator:
            _warned_no_accelerator = True
            warnings.warn(
                "offloadkit: no CUDA device is available, so activation offloading is inactive "
                "(saved tensors stay where they are). Pass offload_cpu_tensors=True to move CPU "
                "activations, e.g. to a disk tier.",
                RuntimeWarning,
                stacklevel=3,
            )

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _PassEnds(TimelineListener):
    """The engine's part in every timeline: passes end with their backward. By weak reference:
    a timeline that outlives the manager (shared by a run) does not keep it alive."""

    def __init__(self, manager: OffloadActivations) -> None:
        self.manager = weakref.ref(manager)

    def backward_end(self, task: int) -> None:
        manager = self.manager()
        if manager is not None:
            manager._backward.end_backward(task)
