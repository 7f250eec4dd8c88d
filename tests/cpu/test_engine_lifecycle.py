"""Nothing is left behind between steps, whatever the step did."""

import gc
import weakref

import pytest
import torch

from offloadkit import OffloadActivations, get_act_offloading_ctx_manager
from offloadkit.testing import (
    assert_bitwise_equal,
    build_llama,
    make_batch,
    memory_after_each_step,
    run_step,
)


def cpu_ctx(model, **kw):
    kw.setdefault("min_offload_size", 0)
    return get_act_offloading_ctx_manager(model, offload_cpu_tensors=True, **kw)


def test_retain_graph_double_backward(tiny_llama, tiny_batch):
    def step(ctx=None):
        tiny_llama.zero_grad(set_to_none=True)
        if ctx is None:
            loss = tiny_llama(**tiny_batch).loss
        else:
            with ctx:
                loss = tiny_llama(**tiny_batch).loss
        loss.backward(retain_graph=True)
        first = {n: p.grad.clone() for n, p in tiny_llama.named_parameters()}
        loss.backward()  # every offloaded tensor is unpacked a second time
        return first, {n: p.grad.clone() for n, p in tiny_llama.named_parameters()}

    ref = step()
    ctx = cpu_ctx(tiny_llama)
    got = step(ctx)
    assert_bitwise_equal(ref[0], got[0], "first backward")
    assert_bitwise_equal(ref[1], got[1], "second backward")
    assert ctx.stats.restored_bytes == 2 * ctx.stats.offloaded_bytes
    gc.collect()
    assert ctx.is_idle()


class BoomError(RuntimeError):
    pass


def test_exception_mid_forward_then_normal_step(tiny_llama, tiny_batch):
    ref = run_step(tiny_llama, tiny_batch)
    ctx = cpu_ctx(tiny_llama)
    layer = tiny_llama.model.layers[1]

    def explode(*_):
        raise BoomError("mid-forward")

    handle = layer.register_forward_pre_hook(explode)
    with pytest.raises(BoomError):
        with ctx:
            tiny_llama(**tiny_batch)
    handle.remove()
    assert ctx.is_idle(), "a failed forward must not leave entries behind"
    assert ctx.pool.bytes_in_use == 0
    got = run_step(tiny_llama, tiny_batch, ctx)
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert ctx.is_idle()


def test_gradient_accumulation_inside_one_context(tiny_llama):
    batches = [make_batch(256, 2, 32, seed=s) for s in range(3)]

    def accumulate(ctx=None):
        tiny_llama.zero_grad(set_to_none=True)
        losses = []
        with ctx if ctx is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            for b in batches:
                loss = tiny_llama(**b).loss / len(batches)
                loss.backward()  # backward inside the context, as accumulation loops do
                losses.append(loss.detach())
        return torch.stack(losses), {n: p.grad.clone() for n, p in tiny_llama.named_parameters()}

    ref = accumulate()
    ctx = cpu_ctx(tiny_llama)
    got = accumulate(ctx)
    assert_bitwise_equal(ref[0], got[0], "losses")
    assert_bitwise_equal(ref[1], got[1], "accumulated grads")
    assert ctx.is_idle()


def test_forward_without_backward_releases_everything(tiny_llama, tiny_batch):
    ctx = cpu_ctx(tiny_llama)
    with ctx:
        out = tiny_llama(**tiny_batch)
    assert ctx.live_entries > 0
    probe = weakref.ref(out.loss)
    del out
    assert probe() is None, "the graph must be collectable: no reference cycle through saved tensors"
    assert ctx.is_idle()
    assert ctx.pool.bytes_in_use == 0


def test_eval_under_no_grad_offloads_nothing(tiny_llama, tiny_batch):
    ctx = cpu_ctx(tiny_llama)
    with torch.no_grad(), ctx:
        tiny_llama(**tiny_batch)
    assert ctx.stats.saved_tensors == 0 and ctx.is_idle()


def test_state_empty_after_every_step_and_pool_stops_growing():
    model = build_llama("tiny")
    ctx = cpu_ctx(model)
    allocations = []

    def check():
        assert ctx.is_idle(), f"state left behind after step {len(allocations)}"
        assert ctx.pool.bytes_in_use == 0
        allocations.append(ctx.pool.allocations)

    memory_after_each_step(model, make_batch(256, 2, 32), 50, ctx, check)
    assert allocations[-1] == allocations[1], "host buffers must be reused once warm"
    assert ctx.pool.reuses > 0


def test_unpack_after_close_is_a_clear_error():
    x = torch.randn(128, 128, requires_grad=True)
    ctx = OffloadActivations(offload_cpu_tensors=True, min_offload_size=0)
    with ctx:
        y = x.sin()
    ctx.close()
    # Closing while a graph is alive keeps its host copies until autograd drops them.
    y.sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="closed"):
        with ctx:
            pass


def test_checkpointing_only_packs_block_inputs():
    model = build_llama("tiny")
    batch = make_batch(256, 2, 32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ref = run_step(model, batch)
    ctx = cpu_ctx(model)
    got = run_step(model, batch, ctx)
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    # Per layer only the block input is offloaded, plus the embedding's indices and the
    # final norm's three saved tensors and the head's input outside the checkpointed blocks.
    layers = model.config.num_hidden_layers
    assert layers <= ctx.stats.offloaded_tensors <= layers + 5
    assert ctx.is_idle()
