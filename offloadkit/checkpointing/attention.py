"""Fused attention's outputs kept from a checkpointed block's forward for its recompute.

A non-reentrant checkpoint runs a block forward twice. At long context the attention kernel
is most of the second run: on an H100 at 256K tokens an 8B layer's attention forward takes
about 1 s of the layer's 5 s (forward, recompute and backward together). Its output and
log-sum-exp are small beside that cost: 8 KiB and 128 bytes a token for an 8B layer, one
block input's worth.

:class:`KeptAttention` wraps the function of one checkpoint call. In the first call (the
forward) every fused attention kernel runs as usual and its output and log-sum-exp are
copied to the block-input storage (pinned RAM or disk, on the copy stream, within the host
budget). In the recompute, the copies are brought back as it starts and handed to autograd
in place of running the kernel. Autograd builds the kernel's own backward node around them;
the kernels' forward is deterministic and the recompute calls it on the same values, so the
bytes are the ones the kernel would have produced and gradients are bitwise those of a full
recompute. Where the storage has no room, or the recompute calls a kernel with other shapes,
the kernel runs again; so does a kernel with dropout, whose draws the rest of the recompute's
random numbers follow.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from offloadkit.engine.spans import span_view
from offloadkit.runtime.attention_ops import LARGE_OUTPUTS, AttentionCalls, dropout_of
from offloadkit.runtime.device import current_stream
from offloadkit.runtime.dtensor import DTensorLayout, is_dtensor, local_tensor
from offloadkit.runtime.recompute import output_discarded, output_read
from offloadkit.transfer.completion import order_after

__all__ = ["AttentionKeepStats", "KeptAttention", "MIN_KEPT_BYTES"]

# Outputs smaller than this are not worth a copy each way: they are kept by reference.
MIN_KEPT_BYTES = 1 << 20


@dataclass
class AttentionKeepStats:
    """Counts over the kept attention calls.

    Attributes:
        kept: kernel calls whose outputs went to storage in forward.
        replayed: recompute calls served from storage (the kernel did not run).
        ran_again: recompute calls that ran the kernel (no room in forward, or other shapes).
        kept_bytes: bytes copied to storage.
    """

    kept: int = 0
    replayed: int = 0
    ran_again: int = 0
    kept_bytes: int = 0


@dataclass
class _Output:
    """One large output in storage: how to rebuild the tensor over its storage's bytes."""

    stored: Any
    dtype: torch.dtype
    size: tuple
    stride: tuple
    offset: int
    loaded: Any = None
    consumed: bool = False  # handed to autograd (its bytes were waited for on the consumer's stream)
    layout: DTensorLayout | None = None  # a DTensor's (the bytes are its local tensor's)


@dataclass
class _Call:
    op: Any
    key: tuple  # the tensor arguments' shapes, strides and dtypes
    outputs: list = field(default_factory=list)  # per output: an _Output, or the value itself


def _key(args, kwargs) -> tuple:
    """What must match between forward and recompute: tensor arguments' layouts and every
    other argument's value (causality, dropout, scale)."""

    def one(a):
        return (tuple(a.shape), tuple(a.stride()), a.dtype, a.device) if torch.is_tensor(a) else a

    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _free(tier, calls: list) -> None:
    for call in calls:
        for out in call.outputs:
            if not isinstance(out, _Output):
                continue
            loaded, out.loaded = out.loaded, None
            if loaded is not None and not out.consumed:
                # Brought back but never used: the copy may still be writing the buffer, whose
                # memory returns to the stream it was allocated on. That stream waits first.
                order_after(loaded.alloc_stream, loaded.ready)
            if out.stored is not None:
                tier.free(out.stored)
                out.stored = None
    calls.clear()


# Copies given up by the garbage collector: freed at the next call, not inside the collector,
# which may run while the storage pool holds its lock on this thread.
_given_up: deque = deque()
_given_up_lock = threading.Lock()


def _give_up(tier, calls: list) -> None:
    with _given_up_lock:
        _given_up.append((tier, calls))


def _free_given_up() -> None:
    while True:
        with _given_up_lock:
            if not _given_up:
                return
            tier, calls = _given_up.popleft()
        _free(tier, calls)


class KeptAttention:
    """The function of one checkpoint call, its attention outputs kept for the recompute.

    Its first call is the forward (output read), every later one a recompute (output
    discarded; see ``runtime/recompute.py``).

    Args:
        fn: the block's forward.
        tier: the storage tier of the block inputs (``OffloadActivations.tier``).
        stats: counters shared by the blocks.
        unit: the block, whose output the recompute drops.
    """

    def __init__(self, fn: Callable, tier, stats: AttentionKeepStats, unit: nn.Module | None = None) -> None:
        self.fn, self.tier, self.stats, self.unit = fn, tier, stats, unit
        self.calls = 0
        self._kept: list[_Call] = []
        self._next = 0
        # Freed when the graph holding this function goes (a forward never backpropagated).
        self._release = weakref.finalize(self, _give_up, tier, self._kept)

    def __call__(self, *args, **kwargs):
        _free_given_up()
        self.calls += 1
        if self.calls == 1:
            with output_read(), AttentionCalls(self._keep):
                return self.fn(*args, **kwargs)
        self._load_all()
        self._next = 0
        try:
            with output_discarded(self.unit), AttentionCalls(self._replay):
                return self.fn(*args, **kwargs)
        finally:
            # Once replayed the copies are spent; a second recompute runs the kernels.
            self._release.detach()
            _free(self.tier, self._kept)

    # -- forward -------------------------------------------------------------------------
    def _keep(self, op, args, kwargs, run):
        outputs = run()
        if dropout_of(op, args, kwargs):
            self._kept.append(_Call(op, None))  # runs again: its draws must be drawn again
            return outputs
        call = _Call(op, _key(args, kwargs))
        for i, value in enumerate(outputs):
            call.outputs.append(self._store(value) if i in LARGE_OUTPUTS else value)
        if any(isinstance(o, _Output) and o.stored is None for o in call.outputs):
            _free(self.tier, [call])  # no room for all of it: this call runs again in the recompute
            call = _Call(op, None)
        else:
            self.stats.kept += 1
        self._kept.append(call)
        return outputs

    def _store(self, t):
        if not torch.is_tensor(t):
            return t
        # Context parallelism's attention hands back DTensors: wrappers whose own storage holds
        # no bytes. Their local tensors are kept, and wrapped alike in the recompute.
        layout = DTensorLayout(t) if is_dtensor(t) else None
        local = local_tensor(t)
        if local.untyped_storage().nbytes() < MIN_KEPT_BYTES:
            return t
        storage = local.untyped_storage()
        src = span_view(storage, 0, storage.nbytes(), local.device)
        stored = self.tier.store(src)
        out = _Output(
            stored, local.dtype, tuple(local.shape), tuple(local.stride()), local.storage_offset(), layout=layout
        )
        if stored is None:
            return out
        self.stats.kept_bytes += storage.nbytes()  # counted when stored, kept or not
        if stored.done_stream is not None and stored.done_stream != current_stream(local.device):
            # The copy stream reads the kernel's output: its memory is not reused before that.
            src.record_stream(stored.done_stream)
        return out

    # -- recompute -----------------------------------------------------------------------
    def _load_all(self) -> None:
        """Start bringing every kept output back as the recompute starts, ahead of its kernels."""
        for call in self._kept:
            for out in call.outputs:
                if isinstance(out, _Output) and out.stored is not None and out.loaded is None:
                    out.loaded = self.tier.load(out.stored)

    def _replay(self, op, args, kwargs, run):
        call = self._kept[self._next] if self._next < len(self._kept) else None
        self._next += 1
        if call is None or call.key is None or call.op is not op or call.key != _key(args, kwargs):
            self.stats.ran_again += 1
            return run()
        self.stats.replayed += 1
        return tuple(self._rebuild(out) for out in call.outputs)

    def _rebuild(self, out):
        if not isinstance(out, _Output):
            # Small outputs (RNG state, offsets) as the kernel gave them, each call its own tensor.
            return out.clone() if torch.is_tensor(out) else out
        loaded = out.loaded
        out.consumed = True
        consumer = current_stream(loaded.data.device)
        ready = loaded.ready
        if hasattr(ready, "resolve"):
            ready = ready.resolve()  # a disk read: raises its failure rather than hand back unread bytes
        # The kernel's consumers run on this stream: it waits for the bytes to land.
        order_after(consumer, ready)
        if consumer is not None and loaded.alloc_stream is not None and consumer != loaded.alloc_stream:
            loaded.data.record_stream(consumer)  # freed on the stream it was allocated on
        t = torch.empty(0, dtype=out.dtype, device=loaded.data.device)
        t = t.set_(loaded.data.untyped_storage(), out.offset, out.size, out.stride)
        return out.layout.wrap(t) if out.layout is not None else t
