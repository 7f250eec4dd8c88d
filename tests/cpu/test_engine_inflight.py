"""Paths that only run when copies are still in flight, or when a pass fails: exercised on
CPU with a tier whose copies never report completion."""

import gc

import pytest
import torch

from offloadkit import OffloadActivations
from offloadkit.storage import HostBufferPool, HostMemoryBudget, HostTier


class NeverDone:
    """An event that is never complete: sources stay in the stash until backward."""

    def query(self):
        return False

    def synchronize(self):
        pass


class InFlightTier(HostTier):
    def store(self, src):
        stored = super().store(src)
        if stored is not None:
            stored.done = NeverDone()
        return stored


def make_ctx(**kw):
    budget = HostMemoryBudget(min_free_bytes=0)
    tier = InFlightTier(HostBufferPool(False, budget), use_streams=True)
    return OffloadActivations(offload_cpu_tensors=True, min_offload_size=0, tier=tier, budget=budget, **kw)


def offset_views_loss(x, w):
    h = x @ w  # (64, 64): 16 KiB rows, so row 16 starts past the first 512 bytes
    a = h[16:].sin()  # offset view of h
    b = h[:, 8:40].cos()  # strided, offset
    c, d = h.chunk(2, dim=0)
    return a.sum() + b.sum() + (c * d.tanh()).sum()


@pytest.mark.parametrize("stash", [1, 3, 50])
def test_sources_still_in_flight_are_restored_at_their_offsets(stash):
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    offset_views_loss(x, w).backward()
    ref = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    ctx = make_ctx(max_fwd_stash_size=stash)
    with ctx:
        loss = offset_views_loss(x, w)
    loss.backward()
    assert ctx.stats.stash_hits > 0
    torch.testing.assert_close(x.grad, ref[0], rtol=0, atol=0)
    torch.testing.assert_close(w.grad, ref[1], rtol=0, atol=0)
    assert ctx.is_idle()


class ExplodeError(RuntimeError):
    pass


def test_failed_backward_does_not_leave_a_pass_open():
    x = torch.randn(128, 128, requires_grad=True)
    ctx = OffloadActivations(offload_cpu_tensors=True, min_offload_size=0, prefetch=1, prefetch_bytes=0)

    def step(fail):
        x.grad = None
        with ctx:
            h = x.sin().cos().tanh()
        if fail:
            h.register_hook(lambda g: (_ for _ in ()).throw(ExplodeError("in backward")))
        h.sum().backward()

    step(False)
    step(False)
    assert ctx.stats.replayed_passes == 1
    with pytest.raises(ExplodeError):
        step(True)
    gc.collect()
    assert ctx.is_idle()
    for _ in range(2):
        step(False)
    # the order learned before the failure is replayed again: passes keep being recognised
    assert ctx.stats.replayed_passes == 3
    assert not ctx._passes and ctx.is_idle()
    got = x.grad.clone()
    x.grad = None
    x.sin().cos().tanh().sum().backward()
    torch.testing.assert_close(got, x.grad, rtol=0, atol=0)


def test_handles_dying_after_close_return_host_memory():
    budget = HostMemoryBudget(min_free_bytes=0)
    ctx = OffloadActivations(offload_cpu_tensors=True, min_offload_size=0, budget=budget)
    x = torch.randn(256, 256, requires_grad=True)
    with ctx:
        y = x.sin().cos()
    assert budget.used_bytes > 0
    ctx.close()
    del y  # the graph goes away after close
    gc.collect()
    assert budget.used_bytes == 0
