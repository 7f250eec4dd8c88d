"""Storage-level bookkeeping: which bytes a saved tensor occupies, and what autograd holds.

offloadkit moves *storage byte ranges*, never tensors: several saved tensors that share a
storage (views, transposes, shifted slices) are moved once and restored as views of one
copy, with their original sizes, strides and offsets. Nothing is cloned, so offset and
non-contiguous tensors need no temporary copies (and no stream to run them on).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from offloadkit.runtime.autograd import version_alias
from offloadkit.runtime.storages import StorageRef, version_of

__all__ = ["ALIGN", "DeathQueue", "Entry", "Kept", "Packed", "inplace_error", "storage_span", "span_view"]

# The CUDA caching allocator hands out 512-byte aligned blocks. Copying from a 512-aligned
# start keeps every restored tensor's address congruent to the original modulo 512, so
# kernels that pick a code path by alignment pick the same one: results stay bitwise equal.
ALIGN = 512


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    """``(start, end)`` byte offsets within ``t``'s storage that cover every element of ``t``.

    ``start`` is aligned down to :data:`ALIGN` relative to the storage base.
    """
    itemsize = t.element_size()
    first = t.storage_offset() * itemsize
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return int(first - first % ALIGN), int(first + extent * itemsize)


def span_view(storage: torch.UntypedStorage, start: int, end: int, device: torch.device) -> torch.Tensor:
    """A plain uint8 tensor over ``storage[start:end]`` with no autograd history."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (end - start,), (1,))


@dataclass(eq=False)
class Entry:
    """One offloaded storage range and everything the engine tracks about it.

    Lifetime: created by the first saved tensor in the range; every saved tensor served
    by it holds a :class:`Packed` handle; when the last handle is gone (autograd released
    it after backward, or the graph was dropped), the entry and its host copy are freed.
    """

    key: int  # StorageImpl address; stable while ``weak`` is held
    weak: StorageRef
    start: int
    end: int
    device: torch.device
    stored: Any  # storage.base.Stored
    version: int = 0  # the source's version counter when the copy was taken
    pos: int = -1  # position in its step's backward-order list
    seq: int = -1  # creation index within its forward (keys the learned backward order)
    step: Any = None  # the prefetch.Step (forward / graph) it belongs to
    group: int | None = None  # save group (one checkpointed block's inputs): fetched together
    born: int = 0  # its saver's index among the saves of its thread
    span_start: int = 0  # the bytes its saver (and savers merged into it) needed; the copy may
    span_end: int = 0  # cover the whole storage (see engine.forward.NEAR_SAVES)
    live: int = 0  # handles alive (including those of entries merged into it)
    # Forward: the device source, kept alive while its copy is in flight.
    src: torch.Tensor | None = None
    src_stream: object = None
    # Backward: the resident device copy (prefetched, or the source itself).
    gpu: torch.Tensor | None = None
    gpu_ready: object = None  # event to wait on before use (None: ready)
    gpu_guard: tuple | None = None  # (stream, event) to wait on before the memory is dropped
    gpu_stream: object = None  # stream the resident memory belongs to
    gen: int = 0  # bumped every time a new resident copy is made
    waiting: int = 0  # live handles that have not consumed the current resident copy
    prefetched: bool = False
    released: bool = False
    # Set when a later save covered this entry's range and more: its handles are served by
    # ``merged_into`` (``shift`` bytes further in), and its own copy was given back.
    merged_into: "Entry | None" = None
    shift: int = 0
    # Holds only outputs a checkpoint's recompute takes instead of computing them again: they
    # come back as their block's recompute begins, not with the look-ahead (engine/backward.py).
    for_recompute: bool = False

    # -- every change of an entry's state is one of these (the engine reads fields, and
    # -- writes them only through here) --------------------------------------------------
    def first_saved(self, group: int | None, born: int, span: tuple[int, int]) -> None:
        """The save that created this entry: its group, its index and the bytes it needed."""
        self.group, self.born = group, born
        self.span_start, self.span_end = span

    def saved_again(self, group: int | None, for_recompute: bool = False) -> None:
        """A later save is served by this entry: backward needs it with that saver's group (and,
        for a saved tensor's, when the look-ahead brings the group back)."""
        self.group = group
        self.mark_for_recompute(self.for_recompute and for_recompute)

    def mark_for_recompute(self, flag: bool) -> None:
        """Whether it holds only outputs kept for a recompute; its step counts those (they are
        left out of the learned order of use: see engine/prefetch.py)."""
        if self.step is not None:
            if flag:
                self.step.outputs.add(self.seq)
            else:
                self.step.outputs.discard(self.seq)
        self.for_recompute = flag

    def add_handle(self) -> None:
        self.live += 1

    def merge_into(self, new: "Entry") -> None:
        """``new`` covers this entry's range: it serves this entry's handles from now on."""
        self.merged_into, self.shift = new, self.start - new.start
        new.live += self.live

    def keep_source(self, src: torch.Tensor, stream) -> None:
        """Keep the device source alive while its copy to the host is in flight."""
        self.src, self.src_stream = src, stream

    def drop_source(self) -> None:
        self.src = None

    def place(self, step, seq: int) -> None:
        """Its forward (step) and creation index in it."""
        self.step, self.seq = step, seq

    def make_resident(self, data: torch.Tensor, ready, stream, guard) -> None:
        """A new device copy to serve backward: every live handle has yet to read it."""
        self.gpu, self.gpu_ready, self.gpu_stream, self.gpu_guard = data, ready, stream, guard
        self.gen += 1
        self.waiting = self.live
        self.prefetched = False

    def mark_prefetched(self, prefetched: bool) -> None:
        self.prefetched = prefetched

    def consumed_by_one(self) -> bool:
        """A handle read the resident copy; True once every handle has."""
        self.waiting -= 1
        return self.waiting <= 0

    def drop_resident(self) -> None:
        self.gpu = self.gpu_ready = self.gpu_guard = self.gpu_stream = None
        self.prefetched = False

    def handle_died(self, seen_gen: int) -> tuple[bool, bool]:
        """A handle autograd held is gone.

        Returns:
            ``(unawaited, last)``: no live handle waits for the resident copy any more, and
            this was the last handle.
        """
        self.live -= 1
        unawaited = False
        if self.gpu is not None and seen_gen != self.gen:
            self.waiting -= 1  # it will never read the resident copy
            unawaited = self.waiting <= 0
        return unawaited, self.live <= 0

    def release(self) -> None:
        self.released = True

    def resolve(self) -> tuple["Entry", int]:
        """The entry that holds this one's bytes now, and the byte offset of ours in it."""
        entry, shift = self, 0
        while entry.merged_into is not None:
            shift += entry.shift
            entry = entry.merged_into
        return entry, shift

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class DeathQueue:
    """Where dying :class:`Packed` handles report. While the engine is open, deaths are only
    enqueued (they may happen on any thread, even inside the engine's own critical
    sections) and processed under the engine's lock; once it is closed, they are handled on
    the spot so that host buffers still go back."""

    def __init__(self) -> None:
        self._queue: deque = deque()
        self._after_close = None  # callable(entry, seen_gen), set by close()
        self._lock = threading.Lock()

    def append(self, item) -> None:
        # The handler (after close) takes the engine's lock: call it outside ours, so the
        # two locks are never taken in opposite orders.
        with self._lock:
            handler = self._after_close
            if handler is None:
                self._queue.append(item)
                return
        handler(*item)

    def popleft(self):
        return self._queue.popleft()

    def close(self, handler) -> None:
        with self._lock:
            self._after_close = handler
            pending = list(self._queue)
            self._queue.clear()
        for item in pending:
            handler(*item)

    def __bool__(self) -> bool:
        return bool(self._queue)


class Packed:
    """What autograd stores for an offloaded tensor: a handle, never the tensor itself.

    Holding the tensor would form a reference cycle (tensor -> grad_fn -> saved -> tensor)
    that keeps the graph alive when no backward runs. An empty alias sharing the tensor's
    version counter (:func:`~offloadkit.runtime.autograd.version_alias`) and the value it had
    let unpack detect an in-place write after the save exactly as autograd does (saved-tensor
    hooks switch autograd's own check off), also when the saved tensor object itself is gone
    and a view of it was written.
    """

    __slots__ = (
        "entry",
        "dtype",
        "size",
        "stride",
        "offset",
        "itemsize",
        "version",
        "alias",
        "ref",
        "seen_gen",
        "copied",
        "_dead",
        "__weakref__",
    )

    def __init__(self, entry: Entry, t: torch.Tensor, dead: DeathQueue, copied: bool = True) -> None:
        self.entry = entry
        self.copied = copied  # this save started the copy (False: served by an earlier save's copy)
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.itemsize = t.element_size()
        # elements from the entry's first byte (entry.start is a multiple of every itemsize)
        self.offset = (t.storage_offset() * self.itemsize - entry.start) // self.itemsize
        self.version = version_of(t)
        self.alias = version_alias(t)
        self.ref = weakref.ref(t) if self.alias is None else None  # weaker fallback
        self.seen_gen = -1
        self._dead = dead

    def _watched(self) -> torch.Tensor | None:
        return self.alias if self.alias is not None else (self.ref() if self.ref is not None else None)

    def written_since(self) -> bool:
        """The saved tensor (or a view of it) was written in place after the save."""
        t = self._watched()
        return t is not None and version_of(t) != self.version

    def check_version(self) -> None:
        t = self._watched()
        if t is not None and version_of(t) != self.version:
            raise inplace_error(self.dtype, self.size, version_of(t), self.version)

    def __del__(self) -> None:
        # Runs on whichever thread drops the last reference (often an autograd worker).
        try:
            self._dead.append((self.entry, self.seen_gen))
        except Exception:  # interpreter shutdown
            pass


def inplace_error(dtype, size, now: int, expected: int) -> RuntimeError:
    """The error autograd raises for a saved tensor written in place after it was saved."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{dtype}{list(size)}] is at version {now}; expected version "
        f"{expected} instead. Hint: the saved tensor was written in place between forward and "
        "backward (offloadkit keeps autograd's check)"
    )


class Kept:
    """What autograd stores for a tensor that stays where it is: a detached alias (sharing
    memory and version counter) and the version it had, so in-place writes still raise."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()  # never the tensor itself: that would form a reference cycle
        self.version = version_of(t)

    def written_since(self) -> bool:
        """The tensor (or a view of it) was written in place after the save."""
        return version_of(self.tensor) != self.version

    def unpack(self) -> torch.Tensor:
        if self.written_since():
            raise inplace_error(self.tensor.dtype, self.tensor.shape, version_of(self.tensor), self.version)
        return self.tensor


@dataclass
class BackwardOrder:
    """Offloaded entries in the order backward will need them (reverse of last save)."""

    slots: list = field(default_factory=list)

    def push(self, entry: Entry) -> None:
        if entry.pos >= 0 and entry.pos < len(self.slots) and self.slots[entry.pos] is entry:
            self.slots[entry.pos] = None  # a newer save moves it later in forward order
        entry.pos = len(self.slots)
        self.slots.append(entry)

    def remove(self, entry: Entry) -> None:
        if 0 <= entry.pos < len(self.slots) and self.slots[entry.pos] is entry:
            self.slots[entry.pos] = None

    def below(self, pos: int):
        """Entries saved before position ``pos``, newest first."""
        for i in range(min(pos, len(self.slots)) - 1, -1, -1):
            e = self.slots[i]
            if e is not None:
                yield e

    def clear(self) -> None:
        self.slots.clear()

    def __len__(self) -> int:
        return len(self.slots)
