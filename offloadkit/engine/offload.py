"""The activation offloading engine: a ``saved_tensors_hooks`` context manager.

Forward (pack): each saved tensor is checked by the :class:`OffloadPolicy`; offloaded
ones are stored by storage byte range (deduplicated per storage) through a storage
tier, and autograd keeps a small :class:`Packed` handle. The device source stays alive in
a bounded *stash* until its copy has landed.

Backward (unpack): entries come back in the reverse of the order they were last saved.
While entry ``k`` is being used, the next ``prefetch`` entries are already on their way,
so the compute stream only waits for a copy that could not have started earlier. The
resident copy is dropped as soon as every handle sharing it has been unpacked; the host
copy is freed when autograd releases the last handle.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
from collections import deque

import torch
from torch.autograd.graph import saved_tensors_hooks

from offloadkit.engine.policy import OffloadPolicy
from offloadkit.engine.prefetch import PrefetchPlanner, Step
from offloadkit.engine.spans import DeathQueue, Entry, Kept, Packed, span_view, storage_span
from offloadkit.engine.stats import OffloadStats, WaitClock
from offloadkit.runtime.autograd import (
    current_graph_task,
    pop_saved_tensor_hooks,
    push_saved_tensor_hooks,
    queue_engine_callback,
)
from offloadkit.runtime.device import accelerator_available, current_stream
from offloadkit.storage.base import order_after
from offloadkit.storage.budget import HostMemoryBudget
from offloadkit.storage.disk import DiskOptions
from offloadkit.storage.factory import STORAGE_KINDS, build_tier

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
            (``activation_loading_horizon``), >= 0; 0 disables prefetching. ``None``: 2 for
            RAM; 4 for disk storage, whose reads take longer (measured on an 8B LoRA step at
            16K tokens: 3.86 s -> 3.77 s on disk, 3.33 s -> 3.17 s tiered).
        prefetch_bytes: also keep at least this many bytes in flight ahead. Without
            checkpointing, entries range from KiB to hundreds of MiB and a count alone
            leaves the copy engine idle. ``None`` (default): 1/16 of the bytes the step
            offloaded, so the window costs at most ~6% of what offloading saves (a 1B
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

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU())
        >>> manager = OffloadActivations(offload_cpu_tensors=True)
        >>> with manager:
        ...     loss = model(torch.randn(64, 512)).sum()
        >>> loss.backward()
        >>> manager.stats.offloaded_tensors > 0
        True
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_size: int = 1024,
        max_fwd_stash_size: int = 5,
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
    ) -> None:
        _check_args(use_pin_memory=use_pin_memory, use_streams=use_streams, max_fwd_stash_size=max_fwd_stash_size,
                    prefetch=prefetch, prefetch_bytes=prefetch_bytes, host_budget_bytes=host_budget_bytes,
                    storage=storage, disk=disk, offload_cpu_tensors=offload_cpu_tensors)
        device_types = ("cuda", "cpu") if offload_cpu_tensors else ("cuda",)
        self.policy = OffloadPolicy(min_offload_size, device_types)
        self.use_streams = bool(use_streams)
        self.use_pin_memory = bool(use_pin_memory)
        self.max_fwd_stash_size = max_fwd_stash_size
        self.prefetch_bytes = prefetch_bytes
        self._window_bytes = prefetch_bytes or 0  # resolved per backward pass when None
        self.offload_cpu_tensors = bool(offload_cpu_tensors)
        self._check_accelerator()

        self.budget = budget if budget is not None else HostMemoryBudget(host_budget_bytes)
        pin = self.use_pin_memory and accelerator_available()
        if tier is None:
            tier = build_tier(storage, self.budget, pin_memory=pin, use_streams=self.use_streams, disk=disk)
        self.tier = tier
        if prefetch is None:
            prefetch = 2 if tier.name == "ram" else 4
        self.prefetch = prefetch
        self.stats = OffloadStats()
        self._clock = WaitClock(measure_waits and accelerator_available())

        self._lock = threading.RLock()
        self._dead = DeathQueue()  # (entry, seen_gen) from handles that died
        self._entries: set[Entry] = set()
        self._by_storage: dict[int, list[Entry]] = {}
        self._planner = PrefetchPlanner()
        self._stash: deque[Entry] = deque()
        self._passes: dict[int, Step] = {}  # steps being consumed by a backward pass, by step id
        # Forward state is per thread: a forward in another thread (nn.DataParallel replicas,
        # user threads) has its own step, tail and excluded regions.
        self._local = threading.local()
        self._entered_threads: set[int] = set()
        self._groups = itertools.count()
        self._budget_warned = False
        self._handles: list = []  # module hooks attached on this manager's behalf
        self._closed = False
        super().__init__(self._pack, self._unpack)


    # -- context manager -------------------------------------------------------------------
    def __enter__(self):
        if self._closed:
            raise RuntimeError("this OffloadActivations was closed; create a new one")
        with self._lock:
            self._drain()
            self.policy.refresh()
            self._reset_forward()
            self._entered_threads.add(threading.get_ident())
        super().__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        super().__exit__(exc_type, exc, tb)
        with self._lock:
            self._entered_threads.discard(threading.get_ident())
            state = self._state()
            state.tail, state.keep_depth = False, 0
            if exc_type is not None:
                # The graph of a failed forward is about to be dropped; do not pin device memory for it.
                self._flush_stash()
            self._drain()
        return False

    # -- per-thread forward state -------------------------------------------------------------
    def _state(self):
        local = self._local
        if not hasattr(local, "step"):
            local.step, local.tail, local.keep_depth, local.pushed, local.group = None, False, 0, 0, None
        return local

    def _reset_forward(self) -> None:
        state = self._state()
        state.step, state.tail, state.keep_depth = None, False, 0

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

    def update_model_params(self, model: torch.nn.Module) -> None:
        """Never offload ``model``'s parameters (re-read now; call again after they change).

        The name TRL's engine gives this; :meth:`track` does the same.
        """
        self.track(model)

    @property
    def param_storages(self) -> set[int]:
        """Data pointers of the parameter and buffer storages that are never offloaded."""
        return self.policy.storage_pointers()

    def exclude(self, module: torch.nn.Module) -> None:
        """Keep everything ``module`` saves on the device. Detached by :meth:`remove`."""
        self._handles.append(module.register_forward_pre_hook(lambda *_: self.keep_enter()))
        self._handles.append(module.register_forward_hook(lambda *_: self.keep_exit(), always_call=True))

    def mark_forward_start(self) -> None:
        """A new forward begins (called by a root-module pre-hook): a new step."""
        self._reset_forward()

    def forward_pre_hook(self, module, args) -> None:
        """Root-module pre-hook: a new step; and a forward that runs on another thread than the
        one that entered the context (``nn.DataParallel`` replicas, user threads) gets the hooks
        pushed for its duration, since saved-tensor hooks are per thread."""
        self._reset_forward()
        state = self._state()
        if (self._entered_threads and threading.get_ident() not in self._entered_threads
                and torch.is_grad_enabled()):
            push_saved_tensor_hooks(self._pack, self._unpack)
            state.pushed += 1

    def forward_post_hook(self, module, args, output) -> None:
        state = self._state()
        if state.pushed:
            state.pushed -= 1
            pop_saved_tensor_hooks()

    def flush(self) -> None:
        """Let go of every device source whose copy is in flight (GPU-side waits only).

        Called before the output head so that the large logits allocation does not stack
        on top of activations still being copied.
        """
        with self._lock:
            self._flush_stash()

    def mark_tail(self) -> None:
        """The output head has run: keep everything saved in the rest of this forward.

        What follows the head (the loss over full-vocabulary logits) is needed first in
        backward; offloading it only to fetch it straight back costs time and saves nothing
        at the peak.
        """
        with self._lock:
            self._state().tail = True
            self._flush_stash()

    def begin_backward(self, step: Step | None) -> None:
        """Backward reached a known point of ``step``'s graph (the head, a block's output):
        start its pass if it has not started, and top the prefetch window up."""
        if step is None:
            return
        with self._lock:
            self._drain()
            if step.live <= 0:
                return
            self._pass_for(step)
            self._prefetch(step, None)

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
        if self._closed:
            return
        self.remove()
        with self._lock:
            self._flush_stash()
            self._drain()
            self._closed = True
            # Graphs still alive keep their host copies; when autograd drops them, give them back.
            self._dead.close(self._death_after_close)
        self.tier.close()
        self.policy.untrack_all()

    def _death_after_close(self, entry: Entry, seen_gen: int) -> None:
        with self._lock:
            self._handle_died(entry, seen_gen)

    def drain(self) -> None:
        """Process handles autograd has released (done automatically on every hook call)."""
        with self._lock:
            self._drain()
            self._clock.collect(self.stats)

    def is_idle(self) -> bool:
        """True when nothing is held for any graph: no entries, no stash, no resident copies."""
        with self._lock:
            self._drain()
            return not self._entries and not self._stash and not self._by_storage

    @property
    def live_entries(self) -> int:
        with self._lock:
            self._drain()
            return len(self._entries)

    def collect_stats(self, block: bool = True) -> OffloadStats:
        """Stats with all wait timings resolved (``block`` synchronises pending timers)."""
        with self._lock:
            self._clock.collect(self.stats, block=block)
            return self.stats

    def reset_stats(self) -> None:
        with self._lock:
            self._clock.collect(self.stats, block=True)
            self.stats = OffloadStats()

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

    # -- pack ----------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        state = self._state()
        reason = "excluded" if (state.keep_depth or state.tail) else self.policy.keep_reason(t)
        if reason is not None:
            with self._lock:
                self.stats.saved_tensors += 1
                self.stats.note_kept(reason, nbytes)
            return Kept(t)
        with self._lock:
            self.stats.saved_tensors += 1
            self._drain()
            step = state.step
            if step is None or step.passes or step.live <= 0:
                step = state.step = Step()  # a new forward, or one whose backward already began
            storage = t.untyped_storage()
            start, end = storage_span(t)
            entry = self._find(step, storage._cdata, start, end, t._version)
            if entry is not None:
                entry.group = state.group  # needed with its newest saver's group
                self.stats.deduplicated_tensors += 1
                self.stats.deduplicated_bytes += nbytes
                self._planner.on_saved(step, entry, new=False)  # backward needs it at its newest use
            else:
                overlapping = self._overlapping(step, storage._cdata, start, end, t._version)
                if overlapping:
                    start = min(start, *(e.start for e in overlapping))
                    end = max(end, *(e.end for e in overlapping))
                entry = self._offload(step, storage, start, end, t.device, t._version)
                if entry is None:
                    self.stats.note_kept("budget", nbytes)
                    return Kept(t)
                entry.group = state.group
                for old in overlapping:
                    self._merge(old, entry)
            entry.live += 1
            return Packed(entry, t, self._dead)

    def _find(self, step: Step, key: int, start: int, end: int, version: int) -> Entry | None:
        # Same storage and graph, range covered, and no in-place write since the copy was taken
        # (views share their base's version counter).
        for entry in self._by_storage.get(key, ()):
            if entry.step is step and entry.start <= start and end <= entry.end and entry.version == version:
                return entry
        return None

    def _overlapping(self, step: Step, key: int, start: int, end: int, version: int) -> list[Entry]:
        return [e for e in self._by_storage.get(key, ())
                if e.step is step and e.version == version and e.start < end and start < e.end]

    def _merge(self, old: Entry, new: Entry) -> None:
        """``new`` covers ``old``'s range: serve ``old``'s handles from it and give ``old``'s
        copy back, so each storage's bytes are held once (a slice saved before the whole)."""
        old.merged_into, old.shift = new, old.start - new.start
        new.live += old.live
        self.stats.offloaded_bytes -= old.nbytes
        self.stats.offloaded_tensors -= 1
        self.stats.merged_entries += 1
        if old.src is not None:
            try:
                self._stash.remove(old)
            except ValueError:
                pass
            # Copies on one stream run in order: new's copy, queued after, covers old's source.
            same = new.stored.done_stream is not None and old.stored.done_stream is new.stored.done_stream
            self._drop_source(old, wait=not same)
        self._entries.discard(old)
        self._by_storage[old.key].remove(old)
        self._planner.on_released(old)
        old.stored.tier.free(old.stored)  # its pending copy is remembered by the tier

    def _offload(self, step: Step, storage, start: int, end: int, device: torch.device, version: int):
        src = span_view(storage, start, end, device)
        stored = self.tier.store(src)
        if stored is None:
            if not self._budget_warned:
                self._budget_warned = True
                warnings.warn(
                    f"offloadkit: host-memory budget reached ({self.budget.describe()}); further "
                    "activations stay on the device. Raise host_budget_bytes or add a disk tier.",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return None
        entry = Entry(
            key=storage._cdata,
            weak=_weak(storage),
            start=start,
            end=end,
            device=device,
            stored=stored,
            version=version,
        )
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += entry.nbytes
        self._entries.add(entry)
        self._by_storage.setdefault(entry.key, []).append(entry)
        self._planner.on_saved(step, entry, new=True)
        if not stored.copy_finished():
            entry.src, entry.src_stream = src, current_stream(device)
            self._stash.append(entry)
            self._trim_stash()
        return entry

    def _trim_stash(self) -> None:
        stash = self._stash
        # Copies complete in order on the side stream: drop landed sources from the front.
        while stash and stash[0].stored.copy_finished():
            self._drop_source(stash.popleft(), wait=False)
        while len(stash) > self.max_fwd_stash_size:
            self._drop_source(stash.popleft(), wait=True)

    def _drop_source(self, entry: Entry, wait: bool) -> None:
        if wait:
            # The side stream may still read the source: its memory must not be reused on the
            # source's stream until the copy is done (GPU-side wait, no host sync).
            self._clock.wait(entry.src_stream, entry.stored.done, "forward", self.stats)
        entry.src = None

    def _flush_stash(self) -> None:
        while self._stash:
            self._drop_source(self._stash.popleft(), wait=True)

    # -- unpack --------------------------------------------------------------------------------
    def _unpack(self, packed):
        if isinstance(packed, Kept):
            return packed.unpack()
        if not isinstance(packed, Packed):
            return packed
        with self._lock:
            self._drain()
            entry, shift = packed.entry.resolve()
            if entry.released:
                raise RuntimeError(
                    "offloadkit: a saved tensor was unpacked after its offloaded copy was freed "
                    "(was the manager closed while its graph was still alive?)"
                )
            packed.check_version()
            step = entry.step
            self._pass_for(step)
            if entry.gpu is None:
                self._fetch(entry)
                self.stats.prefetch_misses += 1
            elif entry.prefetched:
                self.stats.prefetch_hits += 1
                entry.prefetched = False
            self._planner.on_consumed(step, entry)
            self._prefetch(step, entry)
            consumer = current_stream(entry.device)
            self._clock.wait(consumer, entry.gpu_ready, "backward", self.stats)
            if consumer is not None and entry.gpu_stream is not None and consumer != entry.gpu_stream:
                # Freed memory returns to the stream it was allocated on; record this use too.
                entry.gpu.record_stream(consumer)
            # The resident copy is a fetched buffer (offset 0) or, for a source still on the
            # device, a view of the original storage starting at entry.start.
            offset = (entry.gpu.storage_offset() + shift) // packed.itemsize + packed.offset
            out = torch.empty(0, dtype=packed.dtype, device=entry.device).set_(
                entry.gpu.untyped_storage(), offset, packed.size, packed.stride
            )
            if packed.seen_gen != entry.gen:
                packed.seen_gen = entry.gen
                entry.waiting -= 1
                if entry.waiting <= 0:
                    # Every sharer has its view; ``out`` keeps the memory alive while in use.
                    self._drop_resident(entry, consumed=True)
            return out

    def _pass_for(self, step: Step) -> None:
        """Make sure a backward pass of the current graph task is consuming ``step``."""
        task = current_graph_task()
        if self._passes.get(step.id) is step and step.task == task:
            return
        if self._passes.get(step.id) is step:
            self._finish_pass(step)  # a pass that failed, or a new graph task on the same graph
        if step.passes == 0:
            self._window(step)
        if self._planner.begin_pass(step, task):
            self.stats.replayed_passes += 1
        self._passes[step.id] = step
        if task is not None:
            queue_engine_callback(lambda: self._end_backward(step, task))
        # Sources still on the device are the newest entries: backward needs them first.
        for entry in [e for e in self._stash if e.step is step]:
            self._stash.remove(entry)
            self._make_resident(entry, entry.src, ready=None, stream=entry.src_stream,
                                guard=(entry.src_stream, entry.stored.done))
            entry.src = None
            self.stats.stash_hits += 1
        self._prefetch(step, None)

    def _window(self, step: Step) -> None:
        if self.prefetch_bytes is None:
            step.window_bytes = sum(e.nbytes for e in step.by_seq.values()) // 16
        else:
            step.window_bytes = self.prefetch_bytes

    def _end_backward(self, step: Step, task: int) -> None:
        with self._lock:
            if self._passes.get(step.id) is step and step.task == task:
                self._finish_pass(step)

    def _finish_pass(self, step: Step) -> None:
        self._drain()
        for entry in list(step.by_seq.values()):
            if entry.gpu is not None:
                self._drop_resident(entry, consumed=False)  # fetched but never used this pass
        self._planner.end_pass(step)
        self._passes.pop(step.id, None)
        self._clock.collect(self.stats)

    def _prefetch(self, step: Step, current: Entry | None) -> None:
        if self.prefetch <= 0:
            return
        # The window counts save groups (all inputs of one checkpointed block) or, outside
        # them, single entries: a block whose recompute needs four inputs at once (hidden
        # states, mask, rotary cos/sin) must not use up a window of two on its own.
        ahead = ahead_bytes = 0
        last_group = None
        for entry in self._planner.upcoming(step, current):
            new_group = entry.group is None or entry.group != last_group
            if new_group and ahead >= self.prefetch and ahead_bytes >= step.window_bytes:
                break
            if new_group:
                ahead += 1
                last_group = entry.group
            if entry.gpu is None:
                self._fetch(entry)
                entry.prefetched = True
            ahead_bytes += entry.nbytes

    def _fetch(self, entry: Entry) -> None:
        loaded = entry.stored.tier.load(entry.stored)
        self.stats.restored_bytes += entry.nbytes
        self._make_resident(entry, loaded.data, loaded.ready, loaded.alloc_stream,
                            guard=(loaded.alloc_stream, loaded.ready) if loaded.ready is not None else None)

    def _make_resident(self, entry: Entry, data, ready, stream, guard) -> None:
        entry.gpu, entry.gpu_ready, entry.gpu_stream, entry.gpu_guard = data, ready, stream, guard
        entry.gen += 1
        entry.waiting = entry.live
        entry.prefetched = False

    def _drop_resident(self, entry: Entry, consumed: bool) -> None:
        guard = entry.gpu_guard
        if guard is not None and guard[1] is not None:
            if not consumed or guard[1] is not entry.gpu_ready:
                # Unconsumed prefetch: the copy may still write it. Stash source: the
                # device->host copy may still read it. Either way, order the reuse after it.
                order_after(guard[0], guard[1])
        entry.gpu = entry.gpu_ready = entry.gpu_guard = entry.gpu_stream = None
        entry.prefetched = False

    # -- lifetime ----------------------------------------------------------------------------
    def _drain(self) -> None:
        dead = self._dead
        while dead:
            entry, seen_gen = dead.popleft()
            self._handle_died(entry, seen_gen)

    def _handle_died(self, entry: Entry, seen_gen: int) -> None:
        entry, _ = entry.resolve()
        entry.live -= 1
        if entry.gpu is not None and seen_gen != entry.gen:
            entry.waiting -= 1
            if entry.waiting <= 0:
                self._drop_resident(entry, consumed=False)
        if entry.live <= 0:
            self._release(entry)

    def _release(self, entry: Entry) -> None:
        if entry.released:
            return
        entry.released = True
        if entry.src is not None:
            try:
                self._stash.remove(entry)
            except ValueError:
                pass
            self._drop_source(entry, wait=True)
        if entry.gpu is not None:
            self._drop_resident(entry, consumed=False)
        entry.stored.tier.free(entry.stored)
        self._entries.discard(entry)
        sharers = self._by_storage.get(entry.key)
        if sharers is not None:
            sharers.remove(entry)
            if not sharers:
                del self._by_storage[entry.key]
        self._planner.on_released(entry)
        step = entry.step
        if step is not None and step.live <= 0 and self._passes.get(step.id) is step:
            self._passes.pop(step.id, None)

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


def _weak(storage):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(storage)


def _check_args(**args) -> None:
    """``ValueError`` naming the argument, the value and the fix, before anything is built."""
    for name in ("use_pin_memory", "use_streams", "offload_cpu_tensors"):
        if not isinstance(args[name], bool):
            raise ValueError(f"{name}={args[name]!r} is invalid; pass True or False")
    stash = args["max_fwd_stash_size"]
    if not isinstance(stash, int) or isinstance(stash, bool) or stash < 1:
        raise ValueError(f"max_fwd_stash_size={stash!r} is invalid; it must be an int >= 1 "
                         "(it bounds the device tensors kept alive while their copies are in flight)")
    for name, what in (("prefetch", "entries fetched ahead"), ("prefetch_bytes", "bytes kept in flight ahead"),
                       ("host_budget_bytes", "a byte cap on host memory")):
        value = args[name]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name}={value!r} is invalid; pass an int >= 0 ({what}) or None"
                             + ("; sizes like '16GiB' are read by OffloadConfig" if isinstance(value, str) else ""))
    if args["storage"] not in STORAGE_KINDS:
        raise ValueError(f"storage={args['storage']!r} is invalid; choose one of {', '.join(STORAGE_KINDS)}")
    disk = args["disk"]
    if disk is not None and not isinstance(disk, DiskOptions):
        raise ValueError(f"disk={disk!r} is invalid; pass DiskOptions(directory=...) "
                         f"(e.g. disk=DiskOptions(directory={disk!r})) or None")
