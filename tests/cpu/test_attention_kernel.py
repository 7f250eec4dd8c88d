"""``attention_kernel``: the SDPA backend each decoder layer's attention runs, in its forward and
in its recompute under checkpointing; what cannot run here is refused by name (Python) or
noted with no effect (config); ``remove()`` restores the modules. On a CPU only SDPA's flash
kernel runs, which is also PyTorch's own choice there, so a run with it is bitwise the plain
one. (Each kernel on CUDA: ``tests/gpu/test_attention_kernel_cuda.py``.)"""

import warnings

import pytest
import torch
import torch.nn.functional as F

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.compose import prepare
from offloadkit.config import OffloadConfig
from offloadkit.kernels import AttentionKernelOptions, apply_attention_kernel, attention_kernel_unusable
from offloadkit.testing import build_llama, make_batch

pytest.importorskip("transformers")


@pytest.fixture
def sdpa_calls(monkeypatch):
    """At each SDPA call (the forward's, and the recompute's in backward): the backends it may use."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        b = torch.backends.cuda
        enabled = {
            "flash": b.flash_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(),
            "efficient": b.mem_efficient_sdp_enabled(),
            "math": b.math_sdp_enabled(),
        }
        calls.append(enabled)
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


def test_flash_pins_every_layers_sdpa_calls_in_forward_and_recompute_and_is_bitwise_plain_on_cpu(sdpa_calls):
    reference = _loss_and_grads(_model())
    assert all(c["math"] and c["flash"] for c in sdpa_calls)  # every backend open: PyTorch's choice
    model = _model()
    ckpt = apply_activation_checkpointing(model)
    handle = apply_attention_kernel(model, "flash")
    assert len(handle.modules) == 2
    sdpa_calls.clear()
    got = _loss_and_grads(model)
    # Two layers in forward, the same two again in the checkpoint's recompute.
    assert sdpa_calls == [{"flash": True, "cudnn": False, "efficient": False, "math": False}] * 4
    assert torch.equal(got[0], reference[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], reference[1]))
    # Outside the attention modules the backends are as they were.
    assert torch.backends.cuda.math_sdp_enabled()
    handle.remove()
    ckpt.remove()
    assert all("forward" not in m.__dict__ for _, m in handle.modules)
    sdpa_calls.clear()
    _loss_and_grads(model)
    assert len(sdpa_calls) == 2 and all(c["math"] for c in sdpa_calls)  # PyTorch's own choice again


def test_kernels_that_cannot_run_here_are_refused_by_name():
    model = _model()
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
            if self.rates.get(kernel) is None:
                raise RuntimeError("No available kernel")
            return self.rates[kernel], "cudnn" if kernel == "auto" else kernel

    shape = resolve_shape("llama-3-8b")
    timed = Timed({"auto": 480e12, "cudnn": 481e12, "flash": 400e12, "efficient": 300e12, "fa3": None, "fa4": 560e12})
    rate, kernel, said = budgets_module._fastest_attention(timed, shape)
    assert (rate, kernel) == (560e12, "fa4")
    assert said == "attention (auto (cudnn) 480, cudnn 481, flash 400, efficient 300, fa4 560 TFLOP/s; fastest: fa4)"
    assert {g for _, g in timed.asked} == {shape.kv_heads}  # over the head groups long plans use
    # Within 2% of PyTorch's own choice: keep it (nothing to write in the config).
    timed = Timed({"auto": 480e12, "cudnn": 481e12, "flash": 489e12})
    assert budgets_module._fastest_attention(timed, shape)[:2] == (480e12, "auto")


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
