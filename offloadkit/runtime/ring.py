"""PyTorch's context-parallel (ring) attention, reached through its public context manager,
plus the two private pieces around it: choosing the rotation, and undoing the SDPA patch
when a step raises (torch 2.11's context manager has no ``finally``)."""

from __future__ import annotations

import contextlib

import torch.nn.functional as F

__all__ = ["SDPA", "is_sdpa", "ring_attention", "set_rotation"]

ROTATIONS = ("allgather", "alltoall")

# F.scaled_dot_product_attention as PyTorch defines it. While ring attention runs, the name
# F.scaled_dot_product_attention is a wrapper that turns its inputs into DTensors and calls
# this function; code that intercepts or calls attention must know both.
SDPA = F.scaled_dot_product_attention


def is_sdpa(func) -> bool:
    """Whether ``func`` is scaled dot-product attention: PyTorch's own, or the name as it is
    now (replaced while ring attention runs)."""
    return func is SDPA or func is F.scaled_dot_product_attention


def set_rotation(method: str) -> None:
    """How key/value shards travel between ranks: ``"allgather"`` (one all-gather per layer)
    or ``"alltoall"`` (one exchange per ring step, less memory). Process-wide."""
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(method)


@contextlib.contextmanager
def ring_attention(mesh, buffers: list, seq_dims: list[int]):
    """Shard ``buffers`` in place along ``seq_dims`` (load-balanced for causal attention) and
    route ``F.scaled_dot_product_attention`` through ring attention over ``mesh`` until exit;
    backward must run inside too. The buffers are not restored."""
    from torch.distributed.tensor.experimental import context_parallel

    original = F.scaled_dot_product_attention
    cm = context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=set(buffers))
    cm.__enter__()
    try:
        yield
    except BaseException as exc:
        try:
            cm.__exit__(type(exc), exc, exc.__traceback__)
        except BaseException:
            pass  # the step's own error is the one to report
        finally:
            if F.scaled_dot_product_attention is not original:
                from torch.distributed.tensor.experimental._context_parallel._attention import (
                    _disable_context_parallel_dispatcher_impl,
                )

                _disable_context_parallel_dispatcher_impl()
        raise
    else:
        cm.__exit__(None, None, None)
