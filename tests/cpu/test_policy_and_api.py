"""Policy (what to offload), head discovery, hooks, validation, CPU-only behaviour."""

import warnings

import pytest
import torch
from torch import nn

import offloadkit.engine.offload as offload_mod
from offloadkit import (
    NoOpManager,
    OffloadActivations,
    OffloadPolicy,
    get_act_offloading_ctx_manager,
    get_lora_act_offloading_ctx_manager,
)
from offloadkit.models import find_output_head, unwrap_model
from offloadkit.testing import build_llama, make_batch, run_step


def test_policy_detects_parameters_by_storage():
    lin = nn.Linear(64, 64)
    policy = OffloadPolicy(min_offload_size=0, device_types=("cpu",))
    assert policy.keep_reason(lin.weight) == "parameter"
    assert policy.keep_reason(lin.weight.t()) == "parameter"  # a view: caught through _base
    alias = lin.weight.data  # no Parameter type, no _base
    assert policy.keep_reason(alias) is None
    policy.track(lin)
    assert policy.keep_reason(alias) == "parameter"  # caught by storage
    assert policy.keep_reason(alias[3:]) == "parameter"


def test_policy_detects_buffers_and_refreshes():
    m = nn.BatchNorm1d(256)
    policy = OffloadPolicy(min_offload_size=0, device_types=("cpu",))
    policy.track(m)
    assert policy.keep_reason(m.running_mean.detach()) == "parameter"
    m.running_mean = torch.zeros(256)  # storage replaced
    assert policy.keep_reason(m.running_mean) is None
    policy.refresh()
    assert policy.keep_reason(m.running_mean) == "parameter"


def test_every_rule_decides_in_one_place_in_its_order():
    from offloadkit.engine.decide import KEEP_REASONS, REFUSED_BY_STORAGE, decide

    lin = nn.Linear(64, 64)
    policy = OffloadPolicy(min_offload_size=1024, device_types=("cpu",))
    policy.track(lin)
    big = torch.randn(1024)

    def why(t, closed=False, backward=False, excluded=False):
        return decide(t, policy, closed=closed, in_backward=backward, excluded=excluded).reason

    assert why(big) is None and decide(big, policy, closed=False, in_backward=False, excluded=False).offload
    # The first rule that keeps a tensor names the reason.
    assert why(lin.weight, closed=True, backward=True, excluded=True) == "closed"
    assert why(lin.weight, backward=True, excluded=True) == "backward"
    assert why(lin.weight, excluded=True) == "excluded"
    assert why(torch.randn(8)) == "small"
    assert why(lin.weight) == "parameter"
    assert why(big.to_sparse()) == "unsupported"
    assert why(torch.randn(1024, device="meta")) == "device"
    assert REFUSED_BY_STORAGE.reason == "budget"
    assert {"closed", "backward", "excluded", "unsupported", "device", "small", "parameter", "placed", "budget"} == set(
        KEEP_REASONS
    )
    # A planned place: "gpu" keeps the tensor, "ram"/"disk" offload it there; the rules before still win.
    placed = decide(big, policy, closed=False, in_backward=False, excluded=False, placed="gpu")
    assert placed.reason == "placed"
    assert decide(big, policy, closed=False, in_backward=False, excluded=False, placed="disk").where == "disk"
    assert (
        decide(torch.randn(8), policy, closed=False, in_backward=False, excluded=False, placed="disk").reason == "small"
    )


def test_policy_reasons():
    policy = OffloadPolicy(min_offload_size=1024, device_types=("cpu",))
    assert policy.keep_reason(torch.empty(10)) == "small"
    assert policy.keep_reason(torch.empty(1024)) is None
    assert policy.keep_reason(torch.empty(1024, dtype=torch.complex64).conj()) == "unsupported"
    assert policy.keep_reason(torch.empty(1024).to_sparse()) == "unsupported"
    assert OffloadPolicy(device_types=("cuda",)).keep_reason(torch.empty(4096)) == "device"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_fwd_stash_size=0), "max_fwd_stash_size"),
        (dict(max_fwd_stash_size=1.5), "max_fwd_stash_size"),
        (dict(min_offload_size=-1), "min_offload_size"),
        (dict(prefetch=-2), "prefetch"),
        (dict(host_budget_bytes=-3), "host_budget_bytes"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        OffloadActivations(offload_cpu_tensors=True, **kwargs)


def test_model_must_be_a_module():
    with pytest.raises(ValueError, match="model must be a torch.nn.Module"):
        get_act_offloading_ctx_manager({"not": "a model"})


def test_no_accelerator_construct_warns_once_and_offloads_nothing(monkeypatch, tiny_llama, tiny_batch):
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    monkeypatch.setattr(offload_mod, "_warned_no_accelerator", False)
    with pytest.warns(RuntimeWarning, match="no CUDA device"):
        ctx = get_act_offloading_ctx_manager(tiny_llama)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OffloadActivations()  # second construction: silent
    run_step(tiny_llama, tiny_batch, ctx)
    assert ctx.stats.offloaded_tensors == 0
    assert ctx.stats.kept_by_reason["device"] > 0


def test_head_found_for_hf_peft_and_wrappers(tiny_llama):
    assert find_output_head(tiny_llama) is tiny_llama.lm_head

    class DDPLike(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert unwrap_model(DDPLike(tiny_llama)) is tiny_llama
    assert find_output_head(DDPLike(tiny_llama)) is tiny_llama.lm_head
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_llama, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert find_output_head(lora) is tiny_llama.lm_head


def test_head_and_loss_stay_on_device(tiny_llama, tiny_batch):
    ctx = get_act_offloading_ctx_manager(tiny_llama, offload_cpu_tensors=True, min_offload_size=0)
    sizes = []
    orig = ctx.tier.store

    def spy(src):
        sizes.append(src.numel())
        return orig(src)

    ctx.tier.store = spy
    run_step(tiny_llama, tiny_batch, ctx)
    logits_bytes = 2 * 32 * 256 * 4
    assert ctx.stats.kept_by_reason["excluded"] >= 3
    assert max(sizes) < logits_bytes, "logits or their loss intermediates were offloaded"


def test_begin_backward_is_triggered_at_the_head(tiny_llama, tiny_batch):
    ctx = get_act_offloading_ctx_manager(tiny_llama, offload_cpu_tensors=True, min_offload_size=0)
    calls = []
    orig = ctx.begin_backward
    ctx.begin_backward = lambda step: (calls.append(step), orig(step))[1]
    run_step(tiny_llama, tiny_batch, ctx)
    assert calls and calls[0] is not None, "backward prefetch did not start at the head"


def test_exclude_and_remove_hooks(tiny_llama, tiny_batch):
    mlp = tiny_llama.model.layers[0].mlp
    before = {id(m): (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in tiny_llama.modules()}
    ctx = get_act_offloading_ctx_manager(tiny_llama, offload_cpu_tensors=True, min_offload_size=0, exclude=[mlp])
    run_step(tiny_llama, tiny_batch, ctx)
    assert ctx.stats.kept_by_reason["excluded"] >= 5
    ctx.remove()
    after = {id(m): (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in tiny_llama.modules()}
    assert before == after


def test_warns_without_head():
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.warns(UserWarning, match="no output head"):
        get_act_offloading_ctx_manager(model, offload_cpu_tensors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_act_offloading_ctx_manager(model, offload_cpu_tensors=True, warn_if_no_head=False)


def test_noop_manager_opts_out_region():
    x = torch.randn(256, 256, requires_grad=True)
    ctx = OffloadActivations(offload_cpu_tensors=True, min_offload_size=0)
    with ctx:
        a = x.sin()
        with NoOpManager():
            b = a.cos()
    (b.sum()).backward()
    assert ctx.stats.offloaded_tensors == 1  # x only; a stayed
    torch.testing.assert_close(x.grad, -torch.sin(x.detach().sin()) * x.detach().cos(), rtol=0, atol=0)


def test_noop_manager_does_not_leak_graph():
    import weakref

    x = torch.randn(64, requires_grad=True)
    with NoOpManager():
        y = x.exp()  # exp saves its output
    probe = weakref.ref(y)
    del y
    assert probe() is None


def test_context_decorator_and_lora_alias(tiny_llama, tiny_batch):
    ctx = get_lora_act_offloading_ctx_manager(tiny_llama, offload_cpu_tensors=True, min_offload_size=0)

    @ctx
    def forward():
        return tiny_llama(**tiny_batch).loss

    forward().backward()
    assert ctx.stats.offloaded_tensors > 0 and ctx.is_idle()


def test_budget_past_limit_keeps_tensors_and_warns_once(tiny_llama, tiny_batch):
    ref = run_step(tiny_llama, tiny_batch)
    ctx = get_act_offloading_ctx_manager(
        tiny_llama, offload_cpu_tensors=True, min_offload_size=0, host_budget_bytes=64 * 1024
    )
    with pytest.warns(RuntimeWarning, match="budget"):
        got = run_step(tiny_llama, tiny_batch, ctx)
    assert ctx.stats.kept_by_reason["budget"] > 0 and ctx.stats.offloaded_tensors > 0
    assert ctx.budget.peak_bytes <= 64 * 1024
    torch.testing.assert_close(ref[0], got[0], rtol=0, atol=0)
    for k in ref[1]:
        torch.testing.assert_close(ref[1][k], got[1][k], rtol=0, atol=0)


def test_stats_summary_is_printable(tiny_llama, tiny_batch):
    ctx = get_act_offloading_ctx_manager(tiny_llama, offload_cpu_tensors=True, min_offload_size=0)
    run_step(tiny_llama, tiny_batch, ctx)
    text = str(ctx.collect_stats())
    assert "offloaded" in text and "prefetch hits" in text
    d = ctx.stats.as_dict()
    assert d["offloaded_bytes"] == ctx.stats.offloaded_bytes > 0
    ctx.reset_stats()
    assert ctx.stats.offloaded_bytes == 0


def test_prefetch_bookkeeping():
    model = build_llama("tiny")
    batch = make_batch(256, 2, 32)
    ahead = get_act_offloading_ctx_manager(model, offload_cpu_tensors=True, min_offload_size=0, prefetch=2)
    run_step(model, batch, ahead)
    assert ahead.stats.prefetch_misses == 0 and ahead.stats.prefetch_hits == ahead.stats.offloaded_tensors
    lazy = get_act_offloading_ctx_manager(model, offload_cpu_tensors=True, min_offload_size=0, prefetch=0)
    run_step(model, batch, lazy)
    assert lazy.stats.prefetch_hits == 0 and lazy.stats.prefetch_misses == lazy.stats.offloaded_tensors


class FieldOrder(torch.autograd.Function):
    """Saves three tensors; backward unpacks them in save order, not reverse save order."""

    @staticmethod
    def forward(ctx, a, b, c):
        ctx.save_for_backward(a, b, c)
        return a * b * c

    @staticmethod
    def backward(ctx, g):
        a, b, c = ctx.saved_tensors
        return g * b * c, g * a * c, g * a * b


def test_backward_order_is_learned_and_replayed():
    x = torch.randn(512, 512, requires_grad=True)
    ctx = OffloadActivations(offload_cpu_tensors=True, min_offload_size=0, prefetch=1, prefetch_bytes=0)

    def step():
        x.grad = None
        with ctx:
            h = x
            for _ in range(4):
                h = FieldOrder.apply(h.sin(), h.cos(), h.tanh())
        h.sum().backward()
        return x.grad.clone()

    first = step()
    misses_first = ctx.stats.prefetch_misses
    assert misses_first > 0  # the reverse-save guess is wrong inside each node
    ctx.reset_stats()
    second = step()
    assert ctx.stats.replayed_passes == 1
    assert ctx.stats.prefetch_misses == 0, "the recorded order must be replayed exactly"
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_prefetch_bytes_horizon():
    model = build_llama("tiny")
    batch = make_batch(256, 2, 32)
    ctx = get_act_offloading_ctx_manager(
        model, offload_cpu_tensors=True, min_offload_size=0, prefetch=1, prefetch_bytes=1 << 30
    )
    run_step(model, batch, ctx)
    run_step(model, batch, ctx)
    assert ctx.stats.prefetch_misses == 0 and ctx.is_idle()
    with pytest.raises(ValueError, match="prefetch_bytes"):
        OffloadActivations(prefetch_bytes=-1)


def test_freed_parameter_storage_address_is_never_mistaken_for_an_activation():
    lin = nn.Linear(256, 256)
    policy = OffloadPolicy(min_offload_size=0, device_types=("cpu",))
    policy.track(lin)
    old_key = lin.weight.untyped_storage()._cdata
    lin.weight = nn.Parameter(torch.randn(256, 256))  # the tracked storage is freed
    import gc

    gc.collect()
    fresh = [torch.randn(256, 256) for _ in range(200)]
    # the registry's weak reference keeps the old StorageImpl address from being reused
    assert all(t.untyped_storage()._cdata != old_key for t in fresh)
    assert all(policy.keep_reason(t) is None for t in fresh)


def test_storage_ref_tracks_liveness_and_tolerates_a_half_built_object():
    import gc
    import sys

    from offloadkit.runtime.storages import StorageRef

    storage = torch.zeros(4).untyped_storage()
    ref = StorageRef(storage)
    assert not ref.expired()
    del storage
    gc.collect()
    assert ref.expired()
    # A KeyboardInterrupt landing inside __init__ leaves the object without its reference;
    # finalising it must not print "Exception ignored" with a traceback.
    messages = []
    previous = sys.unraisablehook
    sys.unraisablehook = messages.append
    try:
        half = StorageRef.__new__(StorageRef)
        del half
        gc.collect()
    finally:
        sys.unraisablehook = previous
    assert not messages
