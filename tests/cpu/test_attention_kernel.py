"""``attention_kernel``: the SDPA backend each decoder layer's attention prefers, in its forward
and in its recompute under checkpointing; what cannot run here is refused by name (Python) or
noted with no effect (config); ``remove()`` restores the modules. On a CPU, SDPA runs its CPU
flash kernel whatever comes first in the priority order, so a run is bitwise the plain one.
(Each kernel on CUDA: ``tests/gpu/test_attention_kernel_cuda.py``.)"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.compose import prepare
from offloadkit.config import OffloadConfig
from offloadkit.kernels import AttentionKernelOptions, apply_attention_kernel, attention_kernel_unusable
from offloadkit.testing import build_llama, make_batch

pytest.importorskip("transformers")


@pytest.fixture
def sdpa_calls(monkeypatch):
    """At each SDPA call (the forward's, and the recompute's in backward): the backend first in
    SDPA's priority order (read through torch's own getter: nothing public tells it)."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(SDPBackend(torch._C._get_sdp_priority_order()[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def _model(**kw):
    return build_llama("tiny", attn_implementation="sdpa", num_hidden_layers=2, **kw)


def _loss_and_grads(model):
    model.zero_grad(set_to_none=True)
    loss = model(**make_batch(256, 2, 32, seed=3)).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_the_kernel_comes_first_in_every_layers_forward_and_recompute_and_is_bitwise_plain_on_cpu(
    sdpa_calls, monkeypatch
):
    from offloadkit.kernels import attention as attention_module

    # The efficient kernel needs CUDA: its place in the order is what is checked here.
    monkeypatch.setattr(attention_module, "attention_kernel_unusable", lambda kernel, model=None: None)
    reference = _loss_and_grads(_model(num_key_value_heads=4))
    default = sdpa_calls[0]
    assert default != SDPBackend.EFFICIENT_ATTENTION
    model = _model(num_key_value_heads=4)
    ckpt = apply_activation_checkpointing(model)
    handle = apply_attention_kernel(model, "efficient")
    assert len(handle.modules) == 2
    sdpa_calls.clear()
    got = _loss_and_grads(model)
    # Two layers in forward, the same two again in the checkpoint's recompute.
    assert sdpa_calls == [SDPBackend.EFFICIENT_ATTENTION] * 4
    assert torch.equal(got[0], reference[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], reference[1]))
    # Outside the attention modules the order is as it was.
    assert SDPBackend(torch._C._get_sdp_priority_order()[0]) == default
    handle.remove()
    ckpt.remove()
    assert all("forward" not in m.__dict__ for _, m in handle.modules)
    sdpa_calls.clear()
    _loss_and_grads(model)
    assert sdpa_calls == [default] * 2  # PyTorch's own order again


def test_kernels_that_cannot_run_here_are_refused_by_name():
    model = _model(num_key_value_heads=4)
    for kernel in ("cudnn", "efficient", "fa3", "fa4"):
        why = attention_kernel_unusable(kernel, model)
        assert why == "it needs a CUDA GPU", (kernel, why)
        with pytest.raises(ValueError, match=f"attention kernel '{kernel}' cannot run here: it needs a CUDA GPU"):
            apply_attention_kernel(model, kernel)
    eager = build_llama("tiny", attn_implementation="eager")
    assert "not SDPA" in attention_kernel_unusable("flash", eager)
    with pytest.raises(ValueError, match="'auto' leaves SDPA's own choice"):
        apply_attention_kernel(model, "auto")
    assert "forward" not in model.model.layers[0].self_attn.__dict__


def test_a_second_handle_on_the_same_modules_is_refused_and_nothing_is_touched():
    model = _model()
    handle = apply_attention_kernel(model, "flash")
    with pytest.raises(ValueError, match="already has its attention kernel named"):
        apply_attention_kernel(model, "flash")
    handle.remove()
    again = apply_attention_kernel(model, "flash")
    again.remove()


def test_config_key_is_validated_and_prepare_builds_or_notes():
    with pytest.raises(ValueError, match=r"attention_kernel='fa5' is not a kernel offloadkit knows; use one of auto"):
        OffloadConfig.from_dict({"attention_kernel": "fa5"})
    with pytest.raises(ValueError, match=r"kernel='x' is not a kernel"):
        AttentionKernelOptions(kernel="x")
    model = _model()
    runtime = prepare(model, {"attention_kernel": "flash"})
    assert runtime.handles["attention_kernel"].kernel == "flash"
    assert runtime.report()["attention_kernel"] == {"kernel": "flash", "attention_modules": 2}
    runtime.close()
    assert "forward" not in model.model.layers[0].self_attn.__dict__
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        runtime = prepare(model, {"attention_kernel": "cudnn"})
    assert runtime.handles["attention_kernel"] is None
    assert runtime.notes == ["attention_kernel: cudnn has no effect: it needs a CUDA GPU"]
    runtime.close()


def test_measuring_picks_the_fastest_kernel_and_keeps_pytorchs_choice_within_two_percent(monkeypatch):
    from offloadkit.kernels import attention as attention_module
    from offloadkit.planning import budgets as budgets_module
    from offloadkit.planning import resolve_shape

    monkeypatch.setattr(attention_module, "attention_kernel_unusable", lambda kernel, model=None: None)

    class Timed:
        def __init__(self, rates):
            self.rates, self.asked = rates, []

        def attention_rate(self, shape, groups=1, kernel="auto"):
            self.asked.append((kernel, groups))
            if kernel == "fa3":
                raise ModuleNotFoundError("No module named 'cutlass.cute'")
            if self.rates.get(kernel) is None:
                raise RuntimeError("No available kernel")
            return self.rates[kernel], "cudnn" if kernel == "auto" else kernel

    shape = resolve_shape("llama-3-8b")
    timed = Timed({"auto": 480e12, "cudnn": 481e12, "flash": 400e12, "efficient": 300e12, "fa3": None, "fa4": 560e12})
    rate, kernel, said = budgets_module._fastest_attention(timed, shape)
    assert (rate, kernel) == (560e12, "fa4")
    assert said == (
        "attention (auto (cudnn) 480, cudnn 481, flash 400, efficient 300, fa4 560 TFLOP/s; fastest: fa4; "
        "fa3 failed (ModuleNotFoundError))"
    )
    assert {g for _, g in timed.asked} == {shape.kv_heads}  # over the head groups long plans use
    # Within 2% of PyTorch's own choice: keep it (nothing to write in the config).
    timed = Timed({"auto": 480e12, "cudnn": 481e12, "flash": 489e12})
    assert budgets_module._fastest_attention(timed, shape)[:2] == (480e12, "auto")
    # The kernels that could not run here are said, not timed.
    assert budgets_module._fastest_attention(timed, shape)[2].endswith(
        "fastest: auto; efficient failed (RuntimeError); fa3 failed (ModuleNotFoundError); fa4 failed (RuntimeError))"
    )


def test_the_plan_writes_the_measured_kernel_and_says_it():
    from offloadkit.cli.plan import _measured_attention_kernel
    from offloadkit.planning import Budgets, plan
    from offloadkit.planning.timing import Rates

    budgets = Budgets(79 << 30, 100 << 30, 100 << 30).with_rates(
        Rates(attention_flops_per_s=560e12, attention_kernel="fa4", source="measured: attention")
    )
    p = plan("llama-3-8b", 65536, lora_rank=16, budgets=budgets, options=_measured_attention_kernel(budgets))
    assert p.to_config()["attention_kernel"] == "fa4"
    assert "attention 560 TFLOP/s (fa4 kernel)" in p.table()
    auto = Budgets(79 << 30, 100 << 30, 100 << 30)
    assert _measured_attention_kernel(auto) == ()
    assert "attention_kernel" not in plan("llama-3-8b", 65536, lora_rank=16, budgets=auto).to_config()


def test_a_provider_whose_imports_fail_is_noted_and_nothing_stays_wrapped(monkeypatch):
    from offloadkit.kernels import attention as attention_module
    from offloadkit.kernels import component as kernels_component

    monkeypatch.setattr(kernels_component, "attention_kernel_unusable", lambda kernel, model=None: None)
    monkeypatch.setattr(attention_module, "attention_kernel_unusable", lambda kernel, model=None: None)

    def failing(kernel):
        raise ModuleNotFoundError("No module named 'cutlass.cute'")

    monkeypatch.setattr(attention_module, "_activate", failing)
    model = _model()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        runtime = prepare(model, {"attention_kernel": "fa4"})
    assert runtime.handles["attention_kernel"] is None
    assert runtime.notes == ["attention_kernel: fa4 has no effect: ModuleNotFoundError: No module named 'cutlass.cute'"]
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)
    runtime.close()


def test_refusals_name_what_stands_in_the_way():
    grouped = _model()  # 4 heads, 2 key/value heads
    assert attention_kernel_unusable("efficient", grouped) == "the efficient kernel takes no grouped key/value heads"
    ring = _model()
    ring.config._attn_implementation = "offloadkit_context_parallel"
    assert attention_kernel_unusable("flash", ring) == (
        "context parallelism runs its own ring attention kernels (flash or cuDNN)"
    )


def test_removing_a_provider_brings_back_the_one_before_unless_another_came_since(monkeypatch):
    from torch.nn import attention as torch_attention

    from offloadkit.kernels import attention as attention_module

    state = {"active": "FA3"}
    monkeypatch.setattr(torch_attention, "current_flash_attention_impl", lambda: state["active"])
    monkeypatch.setattr(torch_attention, "activate_flash_attention_impl", lambda name: state.update(active=name))
    monkeypatch.setattr(torch_attention, "restore_flash_attention_impl", lambda: state.update(active=None))
    monkeypatch.setattr(attention_module, "attention_kernel_unusable", lambda kernel, model=None: None)
    model = _model()
    handle = apply_attention_kernel(model, "fa4")
    assert state["active"] == "offloadkit-FA4"
    handle.remove()
    assert state["active"] == "FA3"  # the user's provider again, not torch's default
    state["active"] = None
    handle = apply_attention_kernel(model, "fa4")
    state["active"] = "FA3"  # activated by someone else meanwhile
    handle.remove()
    assert state["active"] == "FA3"
    state["active"] = None
    with attention_module.running("fa4"):
        assert state["active"] == "offloadkit-FA4"
    assert state["active"] is None


def test_fa4_reaches_torchs_provider_through_an_interface_that_returns_what_it_unpacks(monkeypatch):
    """flash-attn-4 4.0.0b36's forward returns five values and torch's FA4 provider unpacks
    two: every FA4 call failed. The interface torch's provider is given returns two (and three
    from the backward), passing every argument through; an older release's two pass as they are."""
    import sys
    import types

    from torch.nn import attention as torch_attention

    from offloadkit.runtime import flash_providers

    calls = []
    fake = types.ModuleType("flash_attn.cute.interface")

    def forward(*args, **kwargs):
        calls.append(("fwd", args, kwargs))
        return "out", "lse", "p", "row_max", "o_lo"

    def backward(*args, **kwargs):
        calls.append(("bwd", args, kwargs))
        return "dq", "dk", "dv", "dsink"

    fake._flash_attn_fwd, fake._flash_attn_bwd = forward, backward
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", fake)
    assert flash_providers._flash_attn_fwd(1, 2, 3, causal=True, return_lse=True) == ("out", "lse")
    assert flash_providers._flash_attn_bwd(1, 2, 3, 4, 5, 6, softmax_scale=0.5) == ("dq", "dk", "dv")
    assert calls == [
        ("fwd", (1, 2, 3), {"causal": True, "return_lse": True}),
        ("bwd", (1, 2, 3, 4, 5, 6), {"softmax_scale": 0.5}),
    ]
    fake._flash_attn_fwd = lambda *args, **kwargs: ("out", "lse")
    assert flash_providers._flash_attn_fwd(1, 2, 3) == ("out", "lse")

    assert flash_providers.register_fa4() == flash_providers.FA4_PROVIDER
    assert flash_providers.register_fa4() == flash_providers.FA4_PROVIDER  # once
    names = torch_attention.list_flash_attention_impls()
    assert flash_providers.FA4_PROVIDER in names and "FA4" in names  # torch's own entry stays


def test_a_provider_that_fails_or_misses_a_probe_call_is_refused_with_what_happened(monkeypatch):
    """An installed provider can import and still fail every call (the FA4 release above): one
    small causal call, forward and backward, against attention written out in fp32, says so
    before a model is touched. Run here with CPU kernels standing in for the provider's."""
    import contextlib

    from offloadkit.kernels import attention as attention_module

    real = F.scaled_dot_product_attention
    monkeypatch.setattr(attention_module, "running", lambda kernel: contextlib.nullcontext())
    cpu = torch.device("cpu")

    def probe(sdpa):
        attention_module._PROBED.clear()
        monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
        return attention_module.probe_error("fa4", cpu)

    assert probe(real) is None  # SDPA's own CPU kernel in bf16 is within the tolerance

    def unpacks(*args, **kwargs):
        raise ValueError("too many values to unpack (expected 2)")

    assert probe(unpacks) == ("offloadkit-FA4 fails a probe call (ValueError: too many values to unpack (expected 2))")
    assert probe(lambda *args, **kwargs: real(*args, **kwargs) * 1.1).startswith(
        "offloadkit-FA4's output differs from causal attention in fp32 by"
    )

    def wrong_backward(q, k, v, **kwargs):  # the forward right, dk wrong
        return real(q, k * 1 + (k - k.detach()) * 0.5, v, **kwargs)

    assert probe(wrong_backward).startswith("offloadkit-FA4's dk differs")
    attention_module._PROBED.clear()
