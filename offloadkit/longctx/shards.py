"""Token shards: the pieces every tiled module is run over, and what a tiled norm's output
remembers so that the module it feeds can save the norm's input instead of its output.

A tiled module saves its input. When that input is the output of a tiled norm (the
attention projections after ``input_layernorm``, the MLP after ``post_attention_layernorm``)
the layer would save two ``[S, H]`` tensors where one suffices: the norm saves its own
input anyway. :class:`Prenorm` lets the consumer save the norm's input and rebuild its own
input shard by shard in backward, running the norm over the norm's own shards (the shapes
forward used, so the rebuilt values are the ones forward produced, bit for bit).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

__all__ = [
    "Prenorm",
    "PrenormRows",
    "Recorded",
    "check_tokenwise",
    "run_sharded",
    "shard",
    "shard_bounds",
    "tokens_view",
]


def shard_bounds(length: int, num_shards: int) -> list[tuple[int, int]]:
    """``num_shards`` (at most ``length``) contiguous ``(start, n)`` pieces of ``length``, the first ones one longer."""
    num_shards = max(1, min(num_shards, length))
    size, extra = divmod(length, num_shards)
    out, start = [], 0
    for i in range(num_shards):
        n = size + (1 if i < extra else 0)
        out.append((start, n))
        start += n
    return out


def check_tokenwise(y, xs: torch.Tensor) -> torch.Tensor:
    if not torch.is_tensor(y) or y.shape[:-1] != xs.shape[:-1]:
        got = type(y).__name__ if not torch.is_tensor(y) else f"shape {tuple(y.shape)}"
        raise TypeError(
            f"a tiled module must map [..., S, H] to [..., S, H'] token-wise; for input "
            f"{tuple(xs.shape)} it returned {got}"
        )
    return y


def tokens_view(t: torch.Tensor) -> torch.Tensor:
    """``[B, S, H]`` as ``[1, B*S, H]`` (a view when contiguous): shards of the token
    dimension are then contiguous, so modules that ``.view()`` their input (MoE blocks,
    GPT-2's Conv1D) take them with any batch size. 2-D inputs are already ``[tokens, H]``."""
    return t if t.dim() <= 2 else t.reshape(1, -1, t.shape[-1])


def shard(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return t.narrow(t.dim() - 2, start, n)


class Recorded:
    """What forward knew and backward must restore: the RNG state and the autocast state."""

    def __init__(self, device: torch.device) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device
        self.autocast = [
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in dict.fromkeys((device.type, "cpu"))
        ]

    def replay(self):
        """Context for backward's recompute: forward's RNG draws and autocast dtype."""
        stack = contextlib.ExitStack()
        devices = [self.device] if self.cuda_rng is not None else []
        stack.enter_context(torch.random.fork_rng(devices=devices))
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)
        for kind, enabled, dtype in self.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        return stack


def run_sharded(fn: Callable, inputs: tuple[torch.Tensor, ...], bounds) -> tuple[torch.Tensor, bool]:
    """``fn(*inputs)`` over token shards into one output, and whether ``fn`` writes its
    inputs in place (seen on the first shard, run on a copy: such a module then gets a copy
    of every shard, so the saved input stays as it came)."""
    flat = [tokens_view(t) for t in inputs]
    out = None
    mutates = False
    for i, (start, n) in enumerate(bounds):
        shards = [shard(t, start, n) for t in flat]
        if i == 0:
            copies = [s.clone() for s in shards]
            versions = [c._version for c in copies]
            y = fn(*copies)
            mutates = any(c._version != v for c, v in zip(copies, versions))
            del copies
        else:
            y = fn(*[s.clone() for s in shards] if mutates else shards)
        y = check_tokenwise(y, shards[0])
        if out is None:
            out = y.new_empty(flat[0].shape[:-1] + y.shape[-1:])
        shard(out, start, n).copy_(y)
        del y
    return out.view(inputs[0].shape[:-1] + out.shape[-1:]), mutates


class Prenorm:
    """How a tiled norm made its output: the norm's forward and its token shards.

    Attributes:
        norm: the norm's forward (token-wise).
        bounds: the norm's token shards, over :func:`tokens_view` of its input.
    """

    ATTR = "_offloadkit_prenorm"

    def __init__(self, norm: Callable, bounds: list[tuple[int, int]]) -> None:
        self.norm, self.bounds = norm, bounds

    def mark(self, out: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Tag the norm's output ``out`` with this and the norm's input ``source`` (and the
        versions both have now)."""
        setattr(out, self.ATTR, (self, source, out._version, source._version))
        return out

    @classmethod
    def of(cls, t: torch.Tensor) -> "tuple[Prenorm, torch.Tensor] | None":
        """``(prenorm, source)`` if ``t`` is a tiled norm's output (the tensor itself, not a
        view) and neither it nor the norm's input was written in place since: a rebuilt output
        would otherwise not be the one the consumer read."""
        tag = getattr(t, cls.ATTR, None)
        if not (isinstance(tag, tuple) and len(tag) == 4 and isinstance(tag[0], cls)):
            return None
        pre, source, version, source_version = tag
        if t._version != version or source._version != source_version:
            return None
        return pre, source


class PrenormRows:
    """Rebuilds rows of a norm's output from its saved input in backward, one norm shard
    at a time; consecutive consumer shards reuse the norm shard they share."""

    def __init__(self, pre: Prenorm, source: torch.Tensor) -> None:
        self.norm, self.bounds = pre.norm, pre.bounds
        self.flat = tokens_view(source)
        self._cached: tuple[int, torch.Tensor] | None = None

    def _norm_shard(self, j: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != j:
            self._cached = None  # free the last shard before making the next
            start, n = self.bounds[j]
            x = shard(self.flat, start, n)
            version = x._version
            with torch.no_grad():
                y = check_tokenwise(self.norm(x), x)
            if x._version != version:
                raise RuntimeError("a norm whose output a tiled module rebuilds must not write its input in place")
            self._cached = (j, y)
        return self._cached[1]

    def rows(self, start: int, n: int) -> torch.Tensor:
        """Rows ``[start, start + n)`` of the norm's output (over ``tokens_view``)."""
        pieces = []
        for j, (s0, m) in enumerate(self.bounds):
            lo, hi = max(start, s0), min(start + n, s0 + m)
            if lo < hi:
                pieces.append(self._norm_shard(j).narrow(-2, lo - s0, hi - lo))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)

    def release(self) -> None:
        """Drop the cached norm shard."""
        self._cached = None
