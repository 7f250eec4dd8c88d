"""CUDA tests of the engine: bitwise parity in bf16, races, memory oracle, flatness.

Run on a machine with a GPU: ``pytest -m gpu``. Skipped without CUDA.
"""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offloadkit import OffloadActivations, get_act_offloading_ctx_manager
from offloadkit.engine.stats import WaitClock
from offloadkit.testing import (
    assert_bitwise_equal,
    build_llama,
    make_batch,
    memory_after_each_step,
    randomize_lora_b,
    run_step,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
# ~ tens of milliseconds per copy on an H100: far longer than the kernels around it.
SLOW_COPY_CYCLES = 20_000_000


def small_llama(**kw):
    return build_llama("small", dtype=torch.bfloat16, device=DEV, **kw)


def llama_batch(model, seq=512):
    return make_batch(model.config.vocab_size, 2, seq, device=DEV)


def reference(model, batch):
    a = run_step(model, batch)
    b = run_step(model, batch)
    assert_bitwise_equal(a[1], b[1], "reference is not deterministic; parity would be meaningless")
    return a


@pytest.mark.parametrize("mode", ["streams", "legacy", "unpinned"])
def test_llama_bf16_parity(mode):
    model = small_llama()
    batch = llama_batch(model)
    ref = reference(model, batch)
    kw = dict(streams={}, legacy=dict(use_streams=False), unpinned=dict(use_pin_memory=False))[mode]
    ctx = get_act_offloading_ctx_manager(model, **kw)
    for _ in range(2):  # second step runs on recycled host buffers
        got = run_step(model, batch, ctx)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "grads")
    assert ctx.stats.offloaded_bytes > 0
    assert ctx.is_idle()


def test_lora_bf16_parity():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(small_llama(), peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    randomize_lora_b(model)
    batch = llama_batch(model)
    ref = reference(model, batch)
    ctx = get_act_offloading_ctx_manager(model)
    got = run_step(model, batch, ctx)
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "lora grads")
    assert ctx.is_idle()


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_with_backward_inside_the_region(reentrant):
    """The Trainer's step runs backward inside the region, and on CUDA backward runs on the
    autograd engine's device thread. Non-reentrant recomputation there must see its own saves
    (a CheckpointError otherwise); reentrant recomputation saves through our inherited hooks
    and is kept, not copied out and straight back."""
    model = small_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    batch = llama_batch(model)
    ref = reference(model, batch)
    ctx = get_act_offloading_ctx_manager(model)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with ctx:
            loss = model(**batch).loss
            offloaded = ctx.stats.offloaded_tensors
            loss.backward()
        assert ctx.stats.offloaded_tensors == offloaded > 0, "nothing saved in backward is offloaded"
        assert_bitwise_equal(ref[0], loss.detach(), "loss")
        assert_bitwise_equal(ref[1], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, "grads")
    if reentrant:
        assert ctx.stats.kept_by_reason["backward"] > 0
    assert ctx.is_idle()


def test_checkpointing_plus_offload_parity():
    model = small_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = llama_batch(model)
    ref = reference(model, batch)
    ctx = get_act_offloading_ctx_manager(model)
    got = run_step(model, batch, ctx)
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert ctx.is_idle()


class Sleepy(torch.autograd.Function):
    """Identity whose output is written only after a long device-side sleep: a copy that
    does not wait for the producer reads whatever the allocator left in that memory."""

    @staticmethod
    def forward(ctx, x):
        torch.cuda._sleep(SLOW_COPY_CYCLES)
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g


class Thin(nn.Module):
    """Low arithmetic density: large activations, trivial compute, so copies dominate."""

    def __init__(self, d=2048, layers=12, sleepy=False):
        super().__init__()
        self.w = nn.ParameterList(
            [nn.Parameter(torch.randn(d, device=DEV, dtype=torch.bfloat16)) for _ in range(layers)]
        )
        self.head = nn.Linear(d, 64, device=DEV, dtype=torch.bfloat16)
        self.sleepy = sleepy

    def forward(self, x):
        for w in self.w:
            if self.sleepy:
                x = Sleepy.apply(x)
            x = torch.sin(x) * w + x[:, :1]  # saves x (sin), sin(x) and w (mul), broadcast slice
        return F.log_softmax(self.head(x).float(), -1).mean()


def poison_allocator_cache(like: torch.Tensor, count: int = 64) -> None:
    """Fill cached blocks of ``like``'s size with NaN so a read of unwritten memory shows."""
    junk = [torch.full_like(like, float("nan")) for _ in range(count)]
    del junk


def thin_step(model, x, ctx=None, stream=None, poison=False):
    model.zero_grad(set_to_none=True)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream()):
        if ctx is None:
            loss = model(x)
        else:
            with ctx:
                loss = model(x)
        if poison:
            poison_allocator_cache(x)
        loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _thin_setup(sleepy=False):
    torch.manual_seed(0)
    model = Thin(sleepy=sleepy)
    x = torch.randn(8192, 2048, device=DEV, dtype=torch.bfloat16)
    return model, x


@pytest.mark.parametrize("stash", [1, 5])
def test_race_slow_copies_default_stream(stash, slow):
    model, x = _thin_setup()
    ref = thin_step(model, x)
    ctx = get_act_offloading_ctx_manager(model, max_fwd_stash_size=stash)
    slow(SLOW_COPY_CYCLES)
    for _ in range(2):
        got = thin_step(model, x, ctx)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "grads")
    assert ctx.collect_stats().wait_seconds > 0, "slow copies must show up as measured waits"
    assert ctx.is_idle()


def test_race_slow_producer_and_non_default_stream(slow):
    model, x = _thin_setup(sleepy=True)
    ref = thin_step(model, x)
    side_compute = torch.cuda.Stream()
    ctx = get_act_offloading_ctx_manager(model, max_fwd_stash_size=2)
    slow(SLOW_COPY_CYCLES // 4)
    got = thin_step(model, x, ctx, stream=side_compute)
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert ctx.is_idle()


def test_race_detector_catches_a_missing_wait(monkeypatch, slow):
    """Negative control: with the consumer's wait removed the race test must fail, or the
    race tests above prove nothing."""
    model, x = _thin_setup()
    ref = thin_step(model, x)
    monkeypatch.setattr(WaitClock, "wait", lambda self, stream, event, phase, stats: None)
    ctx = get_act_offloading_ctx_manager(model, prefetch=0)
    slow(SLOW_COPY_CYCLES * 5)
    got = thin_step(model, x, ctx, poison=True)
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_bitwise_equal(ref[1], got[1], "grads")


def test_peak_memory_drops_by_most_of_offloaded_bytes():
    # Activations dominate (as in long-context training): 128 MiB each against 2 MiB weights,
    # so the weight gradients that build up in backward do not mask the saving.
    d, layers, tokens = 1024, 24, 65536
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(d, d, bias=False), nn.GELU()) for _ in range(layers)])
    model = nn.Sequential(blocks, nn.Linear(d, 8, bias=False)).to(DEV, torch.bfloat16)
    x = torch.randn(tokens, d, device=DEV, dtype=torch.bfloat16)

    def peak(ctx=None):
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if ctx is None:
            loss = model(x).float().square().mean()
        else:
            with ctx:
                loss = model(x).float().square().mean()
        loss.backward()
        del loss
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    plain = peak()
    ctx = get_act_offloading_ctx_manager(model, head=model[1])
    peak(ctx)  # warm the host pool
    ctx.reset_stats()
    offloaded = peak(ctx)
    moved = ctx.stats.offloaded_bytes
    per_tensor = tokens * d * 2
    assert moved >= 2 * layers * per_tensor * 0.95  # each block's Linear input and GELU input
    assert plain - offloaded >= 0.8 * moved, (plain, offloaded, moved)


def test_hundred_steps_flat_gpu_and_host_memory():
    gc.collect()  # garbage of earlier tests must not be collected in the middle of this one
    model = small_llama()
    ctx = get_act_offloading_ctx_manager(model)
    pool_allocations = []

    def check():
        assert ctx.is_idle()
        pool_allocations.append(ctx.pool.allocations)

    allocated, rss = memory_after_each_step(model, llama_batch(model, seq=256), 100, ctx, check)
    assert len(set(allocated[5:])) == 1, f"GPU memory drifts: {sorted(set(allocated[5:]))[:4]}"
    assert rss[-1] - rss[5] < 64 << 20, f"host RSS grew {(rss[-1] - rss[5]) >> 20} MiB"
    assert pool_allocations[-1] == pool_allocations[1], "pinned buffers must be reused once warm"


def test_forward_without_backward_and_eval_leave_nothing():
    model = small_llama()
    batch = llama_batch(model, seq=256)
    ctx = get_act_offloading_ctx_manager(model)
    gc.collect()
    with ctx:
        model(**batch)  # warm-up: lazily built caches are not ours to account for
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        with ctx:
            model(**batch)  # graph dropped at once
        with torch.no_grad(), ctx:
            model(**batch)
    torch.cuda.synchronize()
    assert ctx.is_idle()
    assert torch.cuda.memory_allocated() == base
    assert ctx.pool.bytes_in_use == 0


def test_pinned_chunks_are_registered_and_sized_to_the_step():
    model, x = _thin_setup()
    ctx = get_act_offloading_ctx_manager(model)
    thin_step(model, x, ctx)
    chunks = ctx.pool._chunks
    assert chunks and all(c.pinned and c.unregister is not None for c in chunks), "cudaHostRegister path not taken"
    # Page-locked for real: a device->host copy into it returns before it completes
    # (into pageable memory the call would block until the copy is done).
    blk = ctx.pool.acquire(64 << 20)
    src = torch.empty(blk.capacity, dtype=torch.uint8, device=DEV)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLOW_COPY_CYCLES)
        blk.buffer.copy_(src, non_blocking=True)
        done = stream.record_event()
    assert not done.query()
    done.synchronize()
    ctx.pool.release(blk)
    # no power-of-two rounding: held bytes follow what one step offloads
    assert ctx.pool.bytes_held <= ctx.stats.offloaded_bytes * 9 // 8 + (64 << 20) + (8 << 20)


def test_sources_in_flight_at_backward_with_offset_views(slow):
    """Plain manager (no head flush), slow copies: sources are still stashed when backward
    starts and are handed back directly; offset views must land at their offsets."""
    torch.manual_seed(0)
    x = torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)

    def loss_fn():
        h = x @ w
        return h[16:].float().sin().sum() + h[:, 8:400].float().cos().sum() + (h[:2048] * h[2048:]).float().sum()

    loss_fn().backward()
    ref = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    ctx = OffloadActivations(max_fwd_stash_size=50)
    slow(SLOW_COPY_CYCLES)
    with ctx:
        loss = loss_fn()
    loss.backward()
    torch.cuda.synchronize()
    assert ctx.stats.stash_hits > 0
    assert_bitwise_equal(ref[0], x.grad, "x grad")
    assert_bitwise_equal(ref[1], w.grad, "w grad")
    assert ctx.is_idle()


def test_cpu_and_cuda_tensors_share_the_pool_safely(slow):
    """offload_cpu_tensors on a GPU machine: a CPU entry must not reuse a host buffer that a
    pending device copy still writes."""
    torch.manual_seed(0)
    xg = torch.randn(2048, 2048, device=DEV, requires_grad=True)
    xc = torch.randn(2048, 2048, requires_grad=True)

    def run(ctx=None):
        xg.grad = xc.grad = None
        for _ in range(3):
            with ctx if ctx is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                loss = xg.sin().sum() + xc.cos().sum()
            loss.backward()
        torch.cuda.synchronize()
        return xg.grad.clone(), xc.grad.clone()

    ref = run()
    ctx = OffloadActivations(offload_cpu_tensors=True)
    slow(SLOW_COPY_CYCLES)
    got = run(ctx)
    assert_bitwise_equal(ref[0], got[0], "cuda grad")
    assert_bitwise_equal(ref[1], got[1], "cpu grad")


def test_registered_host_memory_is_unregistered_when_dropped():
    import warnings as _w

    from offloadkit.storage import HostBufferPool, HostMemoryBudget

    for _ in range(3):
        pool = HostBufferPool(True, HostMemoryBudget(min_free_bytes=0))
        block = pool.acquire(64 << 20)
        assert block.chunk.unregister is not None
        del pool, block  # never released or closed: the finalizer must unregister
        gc.collect()
    with _w.catch_warnings():
        _w.simplefilter("error")  # no fallback warning: registration keeps working
        pool = HostBufferPool(True, HostMemoryBudget(min_free_bytes=0))
        assert pool.acquire(64 << 20).chunk.unregister is not None
    torch.cuda.synchronize()  # and no stale CUDA error surfaces


def test_inplace_write_of_a_stashed_source_raises(slow):
    """A source still in the forward stash is handed to backward as it is: an in-place
    write after the save must raise autograd's error, not feed modified values."""
    slow(SLOW_COPY_CYCLES)  # keep copies in flight so the source is still stashed at backward
    x = torch.randn(4096, 1024, device=DEV, requires_grad=True)
    ctx = OffloadActivations(max_fwd_stash_size=50)
    with ctx:
        h = x * 2
        out = h.sin()
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    torch.cuda.synchronize()


def test_backward_output_that_views_an_unpacked_tensor_stays_valid(slow):
    """A backward node returns a view of its unpacked activation; that memory must not be
    reused (by a later prefetch or allocation) while the view is still on its way."""

    class ReturnsView(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a.t())
            return torch.zeros(2, 4, device=DEV)

        @staticmethod
        def backward(ctx, grad):
            (saved,) = ctx.saved_tensors
            return saved.t()

    class PassThrough(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a * 3)
            return a.clone()

        @staticmethod
        def backward(ctx, grad):
            torch.cuda._sleep(SLOW_COPY_CYCLES)  # the view travels on while this runs
            return grad.clone()

    x = torch.ones(2048, 1024, device=DEV, requires_grad=True)
    ctx = OffloadActivations(prefetch=4)
    with ctx:
        b = PassThrough.apply(x * 1.0)
        loss = ReturnsView.apply(b * 1.0).sum()
    loss.backward()
    torch.cuda.synchronize()
    assert torch.equal(x.grad, torch.ones_like(x)), "the view's memory was reused too early"


def test_fsdp2_checkpoint_input_offload_with_slow_copies(slow, monkeypatch):
    """FSDP2 (one rank) swaps parameters in and out on its own streams: block inputs offloaded
    under it, with every copy delayed, give FSDP2's own results bitwise."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from offloadkit.checkpointing import apply_activation_checkpointing

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:

        def sharded():
            model = small_llama()
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            return model

        plain, offloaded = sharded(), sharded()
        apply_activation_checkpointing(plain)
        handle = apply_activation_checkpointing(offloaded, offload_inputs=True)
        batch = llama_batch(plain)
        slow(SLOW_COPY_CYCLES // 4)
        for _ in range(2):
            ref, got = run_step(plain, batch), run_step(offloaded, batch)
            assert_bitwise_equal(ref[0], got[0], "loss")
            for name in ref[1]:
                assert_bitwise_equal(ref[1][name].full_tensor(), got[1][name].full_tensor(), name)
        assert handle.offloader.stats.offloaded_tensors > 0 and handle.offloader.is_idle()
    finally:
        dist.destroy_process_group()
