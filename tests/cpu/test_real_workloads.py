"""Real-workload correctness: in-place writes, retained graphs and threads, overlapping saves,
keyword block inputs, variable lengths, evicted streamed weights, disk space and lifetimes,
and the argument errors users meet first. Each test fails on an engine without its fix."""

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

from offloadkit import NoOpManager, OffloadActivations, get_act_offloading_ctx_manager
from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.storage import DiskOptions, HostMemoryBudget
from offloadkit.storage.cleanup import create_private_dir, remove_stale_dirs
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch, run_step

INPLACE = "modified by an inplace operation"


def cpu_ctx(**kw):
    kw.setdefault("min_offload_size", 0)
    return OffloadActivations(offload_cpu_tensors=True, **kw)


# -- in-place writes after a save raise exactly where plain PyTorch raises -------------------
def _raises_like_pytorch(fn):
    with pytest.raises(RuntimeError, match=INPLACE):
        fn(None)  # plain PyTorch
    return fn


@pytest.mark.parametrize("manager", ["offloaded", "kept-small", "noop", "budget"])
def test_inplace_write_of_a_saved_activation_raises(manager):
    def step(ctx):
        x = torch.randn(64, 64, requires_grad=True)
        with ctx if ctx is not None else torch.enable_grad():
            y = x * 2
            z = y.sin()  # saves y
        y.add_(1)  # in place after the save
        z.sum().backward()

    _raises_like_pytorch(step)
    ctx = {
        "offloaded": lambda: cpu_ctx(),
        "kept-small": lambda: cpu_ctx(min_offload_size=1 << 30),
        "noop": lambda: NoOpManager(),
        "budget": lambda: cpu_ctx(budget=HostMemoryBudget(limit_bytes=0, min_free_bytes=0)),
    }[manager]()
    with pytest.raises(RuntimeError, match=INPLACE):
        step(ctx)


def test_inplace_write_of_a_parameter_between_forward_and_backward_raises():
    lin = torch.nn.Linear(32, 32)
    ctx = get_act_offloading_ctx_manager(lin, offload_cpu_tensors=True, min_offload_size=0, warn_if_no_head=False)
    x = torch.randn(8, 32, requires_grad=True)
    with ctx:
        loss = lin(x).square().sum()  # the weight is kept (a parameter), never offloaded
    with torch.no_grad():
        lin.weight.mul_(2)  # e.g. a weight scaled in place before backward
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


def test_inplace_write_through_a_view_when_the_saved_object_is_gone():
    def step(ctx):
        base = torch.randn(64, 64, requires_grad=True) * 1.0
        with ctx if ctx is not None else torch.enable_grad():
            out = base[:32].sin()  # saves a view object that dies right away
        base[40:].zero_()  # slice assignment on the base: same version counter
        out.sum().backward()

    _raises_like_pytorch(step)
    with pytest.raises(RuntimeError, match=INPLACE):
        step(cpu_ctx())


def test_inplace_dropout_after_save_raises():
    def step(ctx):
        x = torch.randn(64, 64, requires_grad=True)
        w = torch.randn(64, 32, requires_grad=True)
        with ctx if ctx is not None else torch.enable_grad():
            h = x * 2.0  # saves nothing
            out = h[:, :32] * w  # saves the slice: a temporary object, gone after this line
        F.dropout(h, 0.5, training=True, inplace=True)  # writes the slice's memory
        (out.sum()).backward()

    _raises_like_pytorch(step)
    with pytest.raises(RuntimeError, match=INPLACE):
        step(cpu_ctx())


def test_no_false_alarm_for_writes_before_the_save():
    x = torch.randn(64, 64, requires_grad=True)
    ctx = cpu_ctx()
    with ctx:
        y = x * 2
        y.add_(1)  # before the save: fine
        z = y.sin()
    z.sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.cos(x.detach() * 2 + 1), rtol=0, atol=0)


# -- graphs, passes and threads ---------------------------------------------------------------
def _chain(x, w, n=3):
    outs, h = [], x
    for _ in range(n):
        h = (h @ w).tanh()
        outs.append(h)
    return outs


def test_partial_grad_on_an_older_retained_graph():
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    ctx = cpu_ctx()
    for _ in range(2):  # learn an order
        with ctx:
            o = _chain(x, w)
        o[-1].sum().backward()
    with ctx:
        old = _chain(x, w)
    old[-1].sum().backward(retain_graph=True)
    with ctx:
        new = _chain(x, w, 4)
    g_old1 = torch.autograd.grad(old[1].sum(), w, retain_graph=True)[0]
    g_new = torch.autograd.grad(new[-1].sum(), w)[0]
    g_old2 = torch.autograd.grad(old[2].sum(), w)[0]
    ref = [
        torch.autograd.grad(_chain(x, w)[1].sum(), w)[0],
        torch.autograd.grad(_chain(x, w, 4)[-1].sum(), w)[0],
        torch.autograd.grad(_chain(x, w)[2].sum(), w)[0],
    ]
    for got, want in zip((g_old1, g_new, g_old2), ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    del old, new
    gc.collect()
    assert ctx.is_idle()


def test_two_threads_share_one_manager():
    w = torch.randn(64, 64, requires_grad=True)
    ctx = cpu_ctx()
    errors, results = [], {}

    def work(i):
        try:
            x = torch.randn(64, 64, generator=torch.Generator().manual_seed(i)).requires_grad_()
            for _ in range(15):
                with ctx:
                    o = _chain(x, w)
                results[i] = torch.autograd.grad(o[-1].sum(), x)[0]
        except Exception as exc:  # pragma: no cover - the failure being tested
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in range(2):
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(i)).requires_grad_()
        want = torch.autograd.grad(_chain(x, w)[-1].sum(), x)[0]
        torch.testing.assert_close(results[i], want, rtol=0, atol=0)


def test_forward_on_another_thread_is_offloaded():
    model = build_llama("tiny")
    batch = make_batch(256, 2, 32)
    ref = run_step(model, batch)
    ctx = get_act_offloading_ctx_manager(model, offload_cpu_tensors=True, min_offload_size=0)
    model.zero_grad(set_to_none=True)
    out = {}
    with ctx:  # entered here, the forward runs elsewhere (like nn.DataParallel replicas)
        t = threading.Thread(target=lambda: out.setdefault("loss", model(**batch).loss))
        t.start()
        t.join()
    out["loss"].backward()
    assert ctx.stats.offloaded_tensors > 0, "the other thread's saved tensors must be offloaded"
    assert_bitwise_equal(ref[0], out["loss"].detach(), "loss")
    assert_bitwise_equal(ref[1], {n: p.grad for n, p in model.named_parameters()}, "grads")


class _ThreadedWrapper(torch.nn.DataParallel):
    """nn.DataParallel as it runs on a machine with GPUs: the model on a worker thread (without
    GPUs, DataParallel calls it on the caller's thread)."""

    def forward(self, **kwargs):
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("v", self.module(**kwargs)))
        t.start()
        t.join()
        return out["v"]


def test_a_wrapper_that_runs_the_model_on_worker_threads_is_followed():
    model = build_llama("tiny")
    batch = make_batch(256, 2, 32)
    ref = run_step(model, batch)
    wrapped = _ThreadedWrapper(model)
    ctx = get_act_offloading_ctx_manager(wrapped, offload_cpu_tensors=True, min_offload_size=0)
    got = run_step(wrapped, batch, ctx)
    assert ctx.stats.offloaded_tensors > 0, "hooks on the inner model follow it onto the worker thread"
    assert_bitwise_equal(ref[1], {k.removeprefix("module."): v for k, v in got[1].items()}, "grads")
    ctx.remove()
    assert not model._forward_pre_hooks and not wrapped._forward_pre_hooks


def test_a_bare_manager_follows_forwards_onto_other_threads_while_its_region_is_open():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    ctx = cpu_ctx()
    out = {}

    def on_a_worker():
        t = threading.Thread(target=lambda: out.__setitem__("y", net(x).sum()))
        t.start()
        t.join()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ctx:
            on_a_worker()
    assert ctx.stats.offloaded_tensors > 0, "the worker's saved tensors were offloaded"
    out["y"].backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, net.parameters()))
    saved = ctx.stats.saved_tensors
    on_a_worker()  # the region is closed: its process-wide hooks are gone
    assert ctx.stats.saved_tensors == saved


class _Gate(torch.nn.Module):
    """Blocks its forward until told to go on: a forward that outlives the region."""

    def __init__(self):
        super().__init__()
        self.inside, self.go = threading.Event(), threading.Event()

    def forward(self, x):
        self.inside.set()
        assert self.go.wait(30)
        return x


@pytest.mark.parametrize("close_during", [False, True])
def test_a_worker_forward_that_ends_after_the_region_leaves_no_hooks_behind(close_during):
    """A forward begun on a worker thread inside the region and ended after it: its saves up
    to the end are the manager's, and the hooks pushed for it are popped at its end, so later
    forwards on that thread are plain (and the process does not abort at exit). Closing the
    manager during that forward does not make it raise."""
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(0)
    gate = _Gate()
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), gate, torch.nn.Tanh(), torch.nn.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    gate.go.set()
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    gate.inside.clear()
    gate.go.clear()
    ctx = cpu_ctx()
    with ThreadPoolExecutor(1) as pool:  # one worker thread, reused
        with ctx:
            future = pool.submit(lambda: net(x).sum())
            assert gate.inside.wait(30)
        if close_during:
            ctx.close()
        gate.go.set()
        loss = future.result()
        loss.backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(ref, net.parameters()))
        saved = ctx.stats.saved_tensors
        assert saved > 0
        pool.submit(lambda: net(x).sum()).result()  # same thread, after the region
        assert ctx.stats.saved_tensors == saved, "the worker thread still had the region's hooks"
        assert not ctx._follow, "process-wide hooks outlived the region"
    ctx.close()


def test_recomputation_in_a_backward_on_another_thread_is_left_to_checkpointing():
    """On CUDA, backward runs on the autograd engine's device thread, so checkpointing
    recomputes its blocks on a thread that never entered the region. Those module forwards
    belong to the recomputation: pushing the offload hooks over checkpointing's own would hide
    the recomputed saves from it. Reproduced on CPU by calling backward from a worker thread."""
    model = build_llama("tiny")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = make_batch(256, 2, 32)
    ref = run_step(model, batch)
    model.zero_grad(set_to_none=True)
    ctx = get_act_offloading_ctx_manager(model, offload_cpu_tensors=True, min_offload_size=0)
    error = {}

    def backward(loss):
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - reported on the test's thread
            error["exc"] = exc

    with ctx:  # forward and backward both inside the region, as Trainer's training_step does
        loss = model(**batch).loss
        t = threading.Thread(target=backward, args=(loss,))
        t.start()
        t.join()
    assert "exc" not in error, error.get("exc")
    assert ctx.stats.offloaded_tensors > 0
    assert_bitwise_equal(ref[0], loss.detach(), "loss")
    assert_bitwise_equal(ref[1], {n: p.grad for n, p in model.named_parameters()}, "grads")


def test_saves_during_a_backward_are_kept_where_they_are():
    """Reentrant checkpointing recomputes each block inside backward, through whatever hooks
    are active: with backward inside the region (the Trainer's training step) those saves
    would be copied out and straight back. They are kept; the forward's saves still move."""
    model = build_llama("tiny")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    batch = make_batch(256, 2, 32)
    ref = run_step(model, batch)
    outside = get_act_offloading_ctx_manager(model, offload_cpu_tensors=True, min_offload_size=0)
    model.zero_grad(set_to_none=True)
    with outside:
        loss = model(**batch).loss
    loss.backward()
    inside = get_act_offloading_ctx_manager(model, offload_cpu_tensors=True, min_offload_size=0)
    model.zero_grad(set_to_none=True)
    with inside:
        loss = model(**batch).loss
        loss.backward()
    assert inside.stats.kept_by_reason["backward"] > 0, "the recomputed blocks saved through our hooks"
    assert inside.stats.offloaded_tensors == outside.stats.offloaded_tensors > 0
    assert_bitwise_equal(ref[0], loss.detach(), "loss")
    assert_bitwise_equal(ref[1], {n: p.grad for n, p in model.named_parameters()}, "grads")
    outside.remove()
    inside.remove()


# -- one copy per storage ----------------------------------------------------------------------
def test_slice_saved_before_the_whole_moves_the_storage_once():
    class SliceFirst(torch.nn.Module):
        def forward(self, x):
            h = x * 3.0
            a = h[:, :16].sin()  # saves a slice of h first
            b = h.cos()  # then the whole of h
            return a.sum() + b.sum()

    x = torch.randn(64, 64, requires_grad=True)
    ctx = cpu_ctx()
    with ctx:
        loss = SliceFirst()(x)
    stats = ctx.stats
    assert stats.offloaded_bytes == 64 * 64 * 4, "h's storage is held once, not the slice and the whole"
    assert stats.copied_bytes == 64 * 64 * 4, "and copied once"
    assert stats.merged_entries == 0
    loss.backward()
    ref = x.detach().requires_grad_()
    SliceFirst()(ref).backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)


def test_chunks_of_a_fused_projection_move_their_storage_once():
    class FusedGateUp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = torch.nn.Linear(32, 128, bias=False)

        def forward(self, x):
            gate, up = self.gate_up(x).chunk(2, dim=-1)  # each half saved by its own op
            return (F.silu(gate) * up).sum()

    model = FusedGateUp()
    x = torch.randn(64, 32, requires_grad=True)
    ctx = cpu_ctx()
    ctx.track(model)
    with ctx:
        loss = model(x)
    fused, silu_out = 64 * 128 * 4, 64 * 64 * 4
    assert ctx.stats.copied_bytes == ctx.stats.offloaded_bytes == fused + x.numel() * 4 + silu_out
    assert ctx.stats.merged_entries == 0 and ctx.stats.deduplicated_tensors >= 1
    loss.backward()
    ref = x.detach().requires_grad_()
    model(ref).backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)


def test_when_the_whole_storage_does_not_fit_the_budget_the_view_alone_moves():
    x = torch.randn(1000, 1024, requires_grad=True)
    ctx = cpu_ctx(host_budget_bytes=3 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no budget warning: the view fits
        with ctx:
            z = (x * 2)[:600].sin()  # 2.4 MB of a 4 MB storage
    assert ctx.stats.offloaded_bytes == 600 * 1024 * 4
    z.sum().backward()


def test_a_part_saved_far_later_gets_its_own_copy_and_no_long_residency():
    x = torch.randn(4096, 256, requires_grad=True)
    ctx = cpu_ctx(prefetch=0)
    with ctx:
        buf = x * 2
        h = buf[:2048].sin()  # the first half: its save moves the whole storage
        for _ in range(6):  # other saves in between
            h = torch.tanh(h * 1.01)
        b = buf[2048:].cos()  # far later: not served by the first copy's extra bytes
        loss = h.sum() + b.sum()
    assert ctx.stats.deduplicated_tensors == 0
    loss.backward()
    ref = x.detach().requires_grad_()
    buf = ref * 2
    h = buf[:2048].sin()
    for _ in range(6):
        h = torch.tanh(h * 1.01)
    (h.sum() + buf[2048:].cos().sum()).backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)


def test_a_small_slice_of_a_large_tensor_moves_only_its_bytes():
    big = torch.randn(1024, 256, requires_grad=True)
    ctx = cpu_ctx()
    with ctx:
        loss = (big[:8] * 2).sin().sum()  # sin saves its input, a fresh [8, 256] tensor...
        tail = big[-4:].exp().sum()  # ...exp saves its output; neither copies big's 1 MiB
    assert ctx.stats.copied_bytes < 64 * 1024
    (loss + tail).backward()


# -- checkpointed blocks called with keyword inputs --------------------------------------------
def test_checkpointed_block_keyword_inputs_are_offloaded():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, hidden_states=None, scale=None):
            return self.lin(hidden_states).tanh() * scale[0]

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            s = (torch.full((64,), 0.5),)
            for layer in self.layers:
                x = layer(hidden_states=x, scale=s)
            return x.sum()

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(32, 64, requires_grad=True)
    net(x).backward()
    ref = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()
    handle = apply_activation_checkpointing(net, offload_inputs=True, offload_cpu_tensors=True, min_offload_size=0)
    net(x).backward()
    stats = handle.offloader.stats
    assert stats.offloaded_tensors >= 2, "keyword hidden_states of the first two blocks are offloaded"
    assert stats.offloaded_bytes >= 2 * 32 * 64 * 4
    assert_bitwise_equal(ref, {n: p.grad for n, p in net.named_parameters()}, "grads")
    handle.remove()


# -- arguments ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(disk="/tmp", storage="disk"), "disk"),
        (dict(host_budget_bytes="1GiB"), "host_budget_bytes"),
        (dict(max_fwd_stash_size=True), "max_fwd_stash_size"),
        (dict(prefetch=True), "prefetch"),
        (dict(use_streams="yes"), "use_streams"),
        (dict(storage="nvme"), "storage"),
        (dict(min_offload_size="1k"), "min_offload_size"),
        (dict(budget="1GiB"), "budget"),
        (dict(tier="disk"), "tier="),
        (dict(measure_waits="no"), "measure_waits"),
    ],
)
def test_wrong_argument_types_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        OffloadActivations(offload_cpu_tensors=True, **kw)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(head="lm_head"), "head="),
        (dict(exclude=[torch.nn.Linear]), "not a module instance"),
        (dict(exclude=3), "exclude="),
    ],
)
def test_wrong_module_arguments_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        get_act_offloading_ctx_manager(torch.nn.Linear(4, 4), offload_cpu_tensors=True, **kw)


def test_empty_tensor_on_a_fixed_storage_is_kept():
    import numpy as np

    empty = torch.from_numpy(np.empty((0, 8), dtype=np.float32))  # a storage that cannot be resized
    w = torch.randn(8, 8, requires_grad=True)
    ctx = cpu_ctx()
    with ctx:
        out = (empty @ w).sum() + (w * 2).sum()
    out.backward()
    assert ctx.stats.kept_by_reason["small"] >= 1


# -- TRL's public surface -----------------------------------------------------------------------
def test_update_model_params_and_param_storages():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 10))
    ctx = cpu_ctx()
    ctx.update_model_params(model)
    assert ctx.param_storages == {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randn(4, 10, requires_grad=True)
    with ctx:
        loss = model(x).sum()
        loss.backward()  # backward inside the context, as TRL's users do
    assert ctx.stats.kept_by_reason["parameter"] > 0 and ctx.stats.offloaded_tensors > 0


def test_tracker_shows_copied_shared_and_kept_saves_until_backward():
    lin = torch.nn.Linear(64, 64)
    ctx = cpu_ctx()
    ctx.update_model_params(lin)
    x = torch.randn(32, 64, requires_grad=True)
    with ctx:
        h = lin(x)  # saves x (copied) and the weight (a parameter: kept)
        y = torch.sigmoid(h)  # saves its output (copied)
        out = (y * y.t().t()).sum()  # saves y again twice, served by its first copy
    saved = ctx.tensor_id
    tracker = ctx.tracker
    assert saved == len(tracker) >= 5
    copied = [v for v in tracker.values() if v[1]]
    assert len(copied) == len(ctx.storage_to_tensor_id) == 2, "x and y: one copy each"
    kept = [v for v in tracker.values() if not v[1] and v[0] is not None]
    assert any(v[0].data_ptr() == lin.weight.data_ptr() for v in kept), "the weight is kept, not copied"
    shared = [v for v in tracker.values() if not v[1] and v[0] is None]
    assert len(shared) >= 1 and all(tuple(v[4]) == (32, 64) for v in shared)
    out.backward()
    assert ctx.tracker == {} and ctx.storage_to_tensor_id == {}, "released with the graph"
    assert ctx.tensor_id == saved, "ids keep counting across steps, as TRL's do"


def test_noop_region_inside_offloading_with_backward_inside():
    model = build_llama("tiny")
    batch = make_batch(256, 2, 16)
    with cpu_ctx() as ctx:
        ref = run_step(model, batch)
        offloaded = ctx.stats.offloaded_tensors
        with NoOpManager():
            got = run_step(model, batch)
    assert offloaded > 0 and ctx.stats.offloaded_tensors == offloaded, "nothing offloaded inside NoOpManager"
    assert_bitwise_equal(ref[1], got[1], "grads")


# -- disk tier lifetimes and space ---------------------------------------------------------------
def test_close_while_a_graph_is_alive_then_backward_reads_from_disk(tmp_path):
    ctx = cpu_ctx(storage="disk", disk=DiskOptions(directory=str(tmp_path)))
    x = torch.randn(256, 256, requires_grad=True)
    with ctx:
        y = x.sin().cos()
    ctx.close()
    y.sum().backward()
    torch.testing.assert_close(x.grad, -torch.sin(torch.sin(x.detach())) * torch.cos(x.detach()), rtol=0, atol=0)


def test_disk_space_follows_what_is_alive(tmp_path):
    ctx = cpu_ctx(storage="disk", disk=DiskOptions(directory=str(tmp_path), direct_io=False))
    w = torch.randn(512, 512, requires_grad=True)
    with ctx:
        kept = (w * 1.0).sin()  # a graph kept alive for the whole run: 1 MiB saved
    step_bytes = 0
    for _ in range(20):
        with ctx:
            loss = (w * 2.0).sin().cos().tanh().sum()
        loss.backward()
        step_bytes = max(step_bytes, ctx.stats.offloaded_bytes)
    alive = 512 * 512 * 4
    assert ctx.tier.disk_bytes() <= alive + (1 << 20), (ctx.tier.disk_bytes(), alive)
    kept.sum().backward()
    ctx.close()


def test_failed_read_returns_its_staging_buffer(tmp_path, monkeypatch):
    import offloadkit.storage.disk as disk_mod

    ctx = cpu_ctx(storage="disk", disk=DiskOptions(directory=str(tmp_path)))
    x = torch.randn(256, 256, requires_grad=True)
    with ctx:
        y = x.sin().cos()
    for e in list(ctx._entries):
        e.stored.payload.write.result()

    def broken(fd, buf, offset):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(disk_mod, "pread_all", broken)
    with pytest.raises(OSError):
        y.sum().backward()
    assert ctx.tier.pool.bytes_in_use == 0, "the staging buffer of a failed read goes back to the pool"
    del y
    gc.collect()
    ctx.close()


LOCK_HOLDER = textwrap.dedent("""
    import os, sys, time
    from offloadkit.storage.cleanup import create_private_dir
    path = create_private_dir(sys.argv[1])
    # Seen from another PID namespace or host, the owner's PID means nothing: rename the
    # directory to a PID that does not exist here; the lock still says the owner is alive.
    fake = os.path.join(os.path.dirname(path), "offloadkit-999999999-" + path.rsplit("-", 1)[1])
    os.rename(path + ".lock", fake + ".lock")
    os.rename(path, fake)
    print(fake, flush=True)
    time.sleep(60)
""")


def test_live_directory_of_a_process_in_another_namespace_is_kept(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        directory = proc.stdout.readline().strip()
        assert os.path.isdir(directory)
        assert remove_stale_dirs(str(tmp_path)) == []
        assert os.path.isdir(directory), "a live owner's directory was removed"
    finally:
        proc.kill()
        proc.wait()
    assert directory in remove_stale_dirs(str(tmp_path)), "once its owner is gone it is stale"


def test_stale_sweep_never_reports_a_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "data").write_bytes(b"x")
    link = tmp_path / "offloadkit-999999999-abc"
    os.symlink(target, link)
    old = time.time() - 3600  # past the start-up grace period: the sweep looks at it for real
    os.utime(link, (old, old), follow_symlinks=False)
    os.utime(target, (old, old))
    assert remove_stale_dirs(str(tmp_path)) == []
    assert target.is_dir() and (target / "data").exists() and link.is_symlink()


def test_symlinked_spill_parent_owned_by_someone_else_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to create a directory owned by another user")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 12345, 12345)
    link = tmp_path / "spill"
    os.symlink(foreign, link)
    with pytest.raises(ValueError, match="symlink"):
        create_private_dir(str(link))
    with pytest.raises(ValueError, match="symlink"):  # a symlink in the middle of the path
        create_private_dir(str(link / "spill"))
    os.symlink(foreign / "not-yet", tmp_path / "dangling")
    with pytest.raises(ValueError, match="symlink"):  # a dangling one, into the same directory
        create_private_dir(str(tmp_path / "dangling"))
    assert not (foreign / "spill").exists() and not (foreign / "not-yet").exists()
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    os.symlink(mine, tmp_path / "ok")
    assert create_private_dir(str(tmp_path / "ok")).startswith(str(mine))
    assert create_private_dir(str(tmp_path / "ok" / "sub")).startswith(str(mine / "sub"))


def test_no_signal_handler_or_exit_hook_at_import():
    code = (
        "import atexit, signal; import offloadkit, offloadkit.storage.disk; "
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, atexit._ncallbacks())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    baseline = subprocess.run(
        [sys.executable, "-c", "import atexit, torch; print(atexit._ncallbacks())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[0] == "True" and out[1] == baseline[0]


def test_second_tier_under_a_symlinked_tmpdir_keeps_the_first(tmp_path, monkeypatch):
    import tempfile

    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    os.symlink(real, link)
    monkeypatch.setenv("TMPDIR", str(link))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    first = cpu_ctx(storage="disk")  # default parent: the symlinked temp dir
    second = cpu_ctx(storage="disk", disk=DiskOptions(directory=str(link)))
    assert os.path.isdir(first.tier.directory), "a second tier swept the first one's live directory"
    x = torch.randn(128, 128, requires_grad=True)
    with first:
        y = x.sin().cos()
    y.sum().backward()
    first.close()
    second.close()


def test_a_failed_read_releases_the_graph_and_the_next_step_works(tmp_path, monkeypatch):
    import offloadkit.storage.disk as disk_mod

    ctx = cpu_ctx(storage="disk", disk=DiskOptions(directory=str(tmp_path)))
    x = torch.randn(256, 256, requires_grad=True)
    with ctx:
        y = x.sin().cos()
    for e in list(ctx._entries):
        e.stored.payload.write.result()
    real = disk_mod.pread_all
    calls = []

    def fail_once(fd, buf, offset):
        if not calls:
            calls.append(1)
            raise OSError(5, "I/O error")
        return real(fd, buf, offset)

    monkeypatch.setattr(disk_mod, "pread_all", fail_once)
    with pytest.raises(OSError):
        y.sum().backward()
    del y
    gc.collect()
    assert ctx.live_entries == 0, "the failed backward's graph must not be kept alive"
    assert ctx.tier.disk_bytes() == 0
    x.grad = None
    with ctx:
        y = x.sin().cos()
    y.sum().backward()
    torch.testing.assert_close(x.grad, -torch.sin(torch.sin(x.detach())) * torch.cos(x.detach()), rtol=0, atol=0)
    ctx.close()
