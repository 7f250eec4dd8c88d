"""Fused attention's outputs kept from a checkpointed block's forward for its recompute.

A non-reentrant checkpoint runs a block forward twice. At long context the attention kernel
is most of the second run: on an H100 at 256K tokens an 8B layer's attention forward takes
about 1 s of the layer's 5 s (forward, recompute and backward together). Its output and
log-sum-exp are small beside that cost: 8 KiB and 128 bytes a token for an 8B layer, one
block input's worth.

:class:`KeptAttention` wraps the function of one checkpoint call. In the first call (the
forward) every fused attention kernel runs as usual and its output and log-sum-exp are handed
to the offloading engine that holds the block's inputs (``save_for_recompute``): the engine's
rule (``engine/decide.py:decide_output``) sends them to its storage as entries of the same
forward and block as those inputs, so backward's prefetch brings them back with the block's
inputs, and they are freed as saved tensors are (their handles go with this object when the
graph dies without backward). In the recompute they are taken back
(``restore_for_recompute``, the engine's waits) and handed to autograd in place of running
the kernel. Autograd builds the kernel's own backward node around them; the kernels' forward
is deterministic and the recompute calls it on the same values, so the bytes are the ones the
kernel would have produced and gradients are bitwise those of a full recompute. Where the
storage has no room, the recompute calls a kernel with other shapes, or an output was written
in place after its kernel, the kernel runs again; so does a kernel with dropout, whose draws
the rest of the recompute's random numbers follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from offloadkit.engine.spans import Kept
from offloadkit.runtime.attention_ops import LARGE_OUTPUTS, AttentionCalls, dropout_of
from offloadkit.runtime.dtensor import DTensorLayout, is_dtensor, local_tensor
from offloadkit.runtime.recompute import output_discarded, output_read

__all__ = ["AttentionKeepStats", "KeptAttention"]


@dataclass
class AttentionKeepStats:
    """Counts over the kept attention calls.

    Attributes:
        kept: kernel calls whose outputs went to storage in forward.
        replayed: recompute calls served from storage (the kernel did not run).
        ran_again: recompute calls that ran the kernel (no room in forward, or other shapes).
        kept_bytes: bytes sent to storage (counted when stored, also for a call that then ran
            again because another of its outputs found no room).
    """

    kept: int = 0
    replayed: int = 0
    ran_again: int = 0
    kept_bytes: int = 0


@dataclass
class _Output:
    """One large output held by the engine: its handle, and a DTensor's layout (the bytes held
    are its local tensor's)."""

    handle: Any
    layout: DTensorLayout | None = None


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


_GONE = object()  # an output the engine no longer has as the kernel made it


class KeptAttention:
    """The function of one checkpoint call, its attention outputs kept for the recompute.

    Its first call is the forward (output read), every later one a recompute (output
    discarded; see ``runtime/recompute.py``).

    Args:
        fn: the block's forward.
        engine: the :class:`~offloadkit.OffloadActivations` that holds the block's inputs.
        stats: counters shared by the blocks.
        unit: the block, whose output the recompute drops.
    """

    def __init__(self, fn: Callable, engine, stats: AttentionKeepStats, unit: nn.Module | None = None) -> None:
        self.fn, self.engine, self.stats, self.unit = fn, engine, stats, unit
        self.calls = 0
        # Per kernel call of the forward, in order. The engine's handles live here: this
        # object goes with the checkpoint's graph, and with it whatever was never replayed.
        self._kept: list[_Call] = []
        self._next = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            with output_read(), AttentionCalls(self._keep):
                return self.fn(*args, **kwargs)
        self._next = 0
        try:
            # Its outputs come back now, while the recompute runs up to its attention.
            self.engine.fetch_for_recompute([o.handle for c in self._kept for o in c.outputs if isinstance(o, _Output)])
            with output_discarded(self.unit), AttentionCalls(self._replay):
                return self.fn(*args, **kwargs)
        finally:
            self._release()

    def _release(self) -> None:
        """Once replayed the copies are spent (a second recompute runs the kernels): their
        handles go, and the engine frees their entries now rather than at its next call."""
        held = any(isinstance(out, _Output) for call in self._kept for out in call.outputs)
        self._kept.clear()
        if held:
            self.engine.drain()

    # -- forward -------------------------------------------------------------------------
    def _keep(self, op, args, kwargs, run):
        outputs = run()
        if dropout_of(op, args, kwargs):
            self._kept.append(_Call(op, None))  # runs again: its draws must be drawn again
            return outputs
        call = _Call(op, _key(args, kwargs))
        for i, value in enumerate(outputs):
            out = self._save(value) if i in LARGE_OUTPUTS else value
            if out is _GONE:
                # Not all of it kept: this call runs again in the recompute, and the handles
                # taken so far go back to the engine with the dropped call.
                call = _Call(op, None)
                break
            call.outputs.append(out)
        else:
            self.stats.kept += 1
        self._kept.append(call)
        return outputs

    def _save(self, t):
        if not torch.is_tensor(t):
            return t
        # Context parallelism's attention hands back DTensors: wrappers whose own storage holds
        # no bytes. Their local tensors are kept, and wrapped alike in the recompute.
        layout = DTensorLayout(t) if is_dtensor(t) else None
        local = local_tensor(t)
        handle = self.engine.save_for_recompute(local)
        if handle is None:
            return _GONE
        if not isinstance(handle, Kept):  # in storage (a small one stays where it is)
            self.stats.kept_bytes += local.numel() * local.element_size()
        return _Output(handle, layout)

    # -- recompute -----------------------------------------------------------------------
    def _replay(self, op, args, kwargs, run):
        call = self._kept[self._next] if self._next < len(self._kept) else None
        self._next += 1
        if call is not None and call.key is not None and call.op is op and call.key == _key(args, kwargs):
            outputs = tuple(self._restore(out) for out in call.outputs)
            if not any(out is _GONE for out in outputs):
                self.stats.replayed += 1
                return outputs
        self.stats.ran_again += 1
        return run()

    def _restore(self, out):
        if not isinstance(out, _Output):
            # Small outputs (RNG state, offsets) as the kernel gave them, each call its own tensor.
            return out.clone() if torch.is_tensor(out) else out
        t = self.engine.restore_for_recompute(out.handle)
        if t is None:
            return _GONE
        return out.layout.wrap(t) if out.layout is not None else t
