"""Liger's fused norm and gated-MLP kernels (``liger_rms_norm``, ``liger_glu_activation``): the
modules they replace and leave, the arguments each replaced forward hands the kernel (checked
against a stand-in module with the kernels' documented arithmetic, in torch), detaching, the
notes where they cannot take effect, the Axolotl keys, ``offload_plan: auto`` and the
planner's count. (The kernels themselves, on CUDA: ``tests/gpu/test_liger_kernels_cuda.py``.)"""

import sys
import types
import warnings

import pytest
import torch

from offloadkit.component import Footprint
from offloadkit.compose import _auto_kernels, prepare
from offloadkit.config import ConfigError, OffloadConfig
from offloadkit.kernels import KernelOptions, apply_liger_kernels
from offloadkit.kernels import component as kernels_component
from offloadkit.kernels import liger as liger_module
from offloadkit.planning import Workload, estimate_memory, resolve_shape
from offloadkit.planning.memory import footprints
from offloadkit.planning.plan import planned_options
from offloadkit.testing import build_llama
from offloadkit.testing.families import build_family, family_batch

GiB = 1 << 30

pytest.importorskip("transformers")


class _RMSNorm:
    """Liger's ``LigerRMSNormFunction`` arithmetic (its docstring), differentiated by autograd:
    llama casts the normed value to the input's dtype before the weight; gemma multiplies in
    fp32 and casts at the end."""

    calls: list = []

    @staticmethod
    def apply(x, w, eps, offset, casting, in_place):
        _RMSNorm.calls.append((offset, casting, eps, in_place))
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if casting == "llama":
            return (offset + w) * normed.to(x.dtype)
        return (normed * (offset + w.float())).to(x.dtype)


class _SiLUMul:
    calls: list = []

    @staticmethod
    def apply(a, b):
        _SiLUMul.calls.append(a.shape)
        return torch.nn.functional.silu(a) * b


@pytest.fixture
def stand_in(monkeypatch):
    """liger_kernel as a stand-in module, its kernels taking CPU tensors."""
    modules = {
        "liger_kernel": types.ModuleType("liger_kernel"),
        "liger_kernel.ops": types.ModuleType("liger_kernel.ops"),
        "liger_kernel.ops.rms_norm": types.ModuleType("liger_kernel.ops.rms_norm"),
        "liger_kernel.ops.swiglu": types.ModuleType("liger_kernel.ops.swiglu"),
    }
    modules["liger_kernel.ops.rms_norm"].LigerRMSNormFunction = _RMSNorm
    modules["liger_kernel.ops.swiglu"].LigerSiLUMulFunction = _SiLUMul
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    liger_module._ops.cache_clear()
    monkeypatch.setattr(liger_module, "_plain", lambda *tensors: True)
    _RMSNorm.calls.clear()
    _SiLUMul.calls.clear()
    yield
    liger_module._ops.cache_clear()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma3", "phi3"])
def test_each_known_module_hands_the_kernel_its_own_arithmetic(stand_in, family):
    model = build_family(family)
    batch = family_batch(family, model, 12)
    with torch.no_grad():
        expected = model(**batch).logits
    handle = apply_liger_kernels(model)
    norms = [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    assert handle.norms == norms and norms
    with torch.no_grad():
        got = model(**batch).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    gemma = family.startswith("gemma")
    assert {c[:2] for c in _RMSNorm.calls} == {(1.0, "gemma") if gemma else (0.0, "llama")}
    assert all(in_place is False for *_, in_place in _RMSNorm.calls)
    eps = {c[2] for c in _RMSNorm.calls}
    assert eps == {model.config.rms_norm_eps}
    if family == "phi3":  # gate and up in one projection: the MLP stays eager
        assert handle.mlps == [] and not _SiLUMul.calls
    elif gemma:  # GELU-gated: not a class the SiLU kernel reproduces
        assert handle.mlps == []
    else:
        assert len(handle.mlps) == model.config.num_hidden_layers == len(_SiLUMul.calls)
    handle.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())
    _RMSNorm.calls.clear()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, expected)
    assert not _RMSNorm.calls


def test_an_mlp_without_silu_stays_eager_and_says_why(stand_in):
    model = build_llama("tiny")
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    handle = apply_liger_kernels(model, rms_norm=False)
    assert handle.mlps == ["model.layers.0.mlp"] and handle.norms == []
    assert handle.skipped == {"model.layers.1.mlp": "activation GELU, not SiLU"}
    with pytest.raises(ValueError, match="already runs Liger's kernels; remove"):
        apply_liger_kernels(model, rms_norm=False)
    handle.remove()
    assert len(apply_liger_kernels(model, rms_norm=False).mlps) == 1


def test_a_call_the_kernel_would_compute_otherwise_runs_the_modules_own_forward(monkeypatch, stand_in):
    model = build_llama("tiny")
    apply_liger_kernels(model)
    monkeypatch.setattr(liger_module, "_plain", lambda *tensors: False)  # CPU tensors, DTensors
    norm = model.model.norm
    x = torch.randn(2, 3, model.config.hidden_size)
    assert torch.equal(norm(x), type(norm).forward(norm, x)) and not _RMSNorm.calls
    monkeypatch.setattr(liger_module, "_plain", lambda *tensors: True)
    # Llama's form multiplies in the weight's dtype: an fp32 weight on a bf16 input is not the kernel's.
    norm.weight.data = norm.weight.data.float()
    y = x.bfloat16()
    assert torch.equal(norm(y), type(norm).forward(norm, y)) and not _RMSNorm.calls


def test_keys_validate_and_an_axolotl_config_keeps_them():
    config = OffloadConfig.from_dict({"liger_rms_norm": True, "liger_glu_activation": False})
    assert config.options(KernelOptions) == KernelOptions(rms_norm=True, glu_activation=False)
    assert OffloadConfig().options(KernelOptions) == KernelOptions()
    with pytest.raises(ConfigError, match=r"liger_rms_norm=1 has the wrong type"):
        OffloadConfig.from_dict({"liger_rms_norm": 1})
    from offloadkit.integrations.axolotl import WITHOUT_EFFECT

    assert "liger_rms_norm" not in WITHOUT_EFFECT and "liger_glu_activation" not in WITHOUT_EFFECT


def test_without_liger_or_a_gpu_prepare_says_the_keys_have_no_effect(monkeypatch):
    monkeypatch.setattr(kernels_component, "liger_unusable", lambda: "liger-kernel is not installed (pip ...)")
    model = build_llama("tiny")
    with pytest.warns(UserWarning, match="liger_rms_norm and liger_glu_activation has no effect: liger-kernel is not"):
        run = prepare(model, {"liger_rms_norm": True, "liger_glu_activation": True})
    assert all("forward" not in m.__dict__ for m in model.modules())
    run.close()


def test_prepare_builds_them_before_the_tiled_mlp_and_close_detaches(monkeypatch, stand_in):
    monkeypatch.setattr(kernels_component, "liger_unusable", lambda: None)
    model = build_llama("tiny")
    batch = family_batch("llama", model, 16)
    expected = model(**batch).logits.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = prepare(
            model, {"liger_rms_norm": True, "liger_glu_activation": True, "tiled_mlp": True, "tiled_mlp_num_shards": 4}
        )
    assert run.report()["liger_kernels"] == {"rms_norms": 5, "gated_mlps": 2}
    out = model(**batch).logits
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)
    assert len(_SiLUMul.calls) == 2 * 4  # the tiled MLP runs the fused forward shard by shard
    out.float().sum().backward()
    run.close()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_offload_plan_auto_turns_them_on_where_they_run_unless_a_key_says(monkeypatch):
    model = build_llama("tiny")
    auto = OffloadConfig(offload_plan="auto")
    monkeypatch.setattr(kernels_component, "liger_unusable", lambda: "Liger's kernels need a GPU")
    assert _auto_kernels(model, auto).options(KernelOptions) == KernelOptions()
    monkeypatch.setattr(kernels_component, "liger_unusable", lambda: None)
    assert _auto_kernels(model, auto).options(KernelOptions) == KernelOptions(True, True)
    declined = auto.replace(liger_glu_activation=False)
    assert _auto_kernels(model, declined).options(KernelOptions) == KernelOptions(True, False)
    # A model with none of the known classes: nothing to turn on.
    assert _auto_kernels(torch.nn.Sequential(torch.nn.Linear(2, 2)), auto).options(KernelOptions) == KernelOptions()


@pytest.mark.parametrize("lora", [16, 0])
@pytest.mark.parametrize("mlp_shards", [1, 8])
def test_the_planner_counts_what_the_kernels_save(lora, mlp_shards):
    shape = resolve_shape("llama-3-8b")
    t, h, i, b = 65536, shape.hidden, shape.intermediate, 2
    w = Workload(shape, t, lora_rank=lora)
    base = planned_options(w, mlp_shards=mlp_shards, loss_chunks=8)
    both = (*base, KernelOptions(rms_norm=True, glu_activation=True))
    kernels = dict(footprints(w, both))["kernels"]
    assert kernels.layer_saved == t * (b * h - 8 * h - (0 if lora else 2 * b * h)) - (
        t * b * i if mlp_shards == 1 else 0
    )
    # The gated backward writes the gate's and up's gradients in place: of the eager one's
    # two 16-bit and one fp32 intermediate-wide tensors a token, one 16-bit is left (and a
    # tiled shard rebuilds no SiLU output).
    rows = -(-t // mlp_shards)
    assert kernels.mlp_backward == -rows * ((2 * b + 4) * i - b * i) - (rows * b * i if mlp_shards > 1 else 0)
    # The input norm's backward: one 16-bit gradient beside the incoming one, not three fp32 tensors.
    assert kernels.attention_backward == t * (2 * b * h - 3 * 4 * h)
    # Tiled norms hold no fp32 [S, H] tensors either way (attention's side counts them 16-bit):
    # nothing to take off there, and the gated backward's saving stays one shard's.
    tiled = planned_options(w, mlp_shards=max(2, mlp_shards), tiled_projections=True, loss_chunks=8)
    tiled_kernels = dict(footprints(w, (*tiled, KernelOptions(rms_norm=True, glu_activation=True))))["kernels"]
    assert tiled_kernels.attention_backward == 0 and tiled_kernels.layer_saved == 0
    shard = -(-t // max(2, mlp_shards))
    assert tiled_kernels.mlp_backward == -shard * ((2 * b + 4) * i - b * i) - shard * b * i
    assert kernels.loss == {"final norm": t * (2 * b * h + 4)}
    assert dict(footprints(w, base))["kernels"] == Footprint()
    assert estimate_memory(w, both).gpu_peak < estimate_memory(w, base).gpu_peak


def test_the_step_time_counts_the_kernels_and_measure_times_them(stand_in):
    from offloadkit.planning import Rates, estimate_time
    from offloadkit.planning.rates import linear_rate
    from offloadkit.planning.timing import LIGER_LINEAR_SPEEDUP

    rates = Rates()
    fused = rates.linear_flops_per_s(True)
    assert rates.linear_flops_per_s(True, 2) == pytest.approx(fused * LIGER_LINEAR_SPEEDUP)
    # The seconds saved per FLOP of the fused path, on PEFT's path too (not its ratio).
    saved = 1 / fused - 1 / rates.linear_flops_per_s(True, 2)
    assert 1 / rates.matmul_flops_per_s - 1 / rates.linear_flops_per_s(False, 2) == pytest.approx(saved)
    assert 1 / rates.matmul_flops_per_s - 1 / rates.linear_flops_per_s(False, 1) == pytest.approx(saved / 2)
    measured = Rates(liger_saving_s_per_flop=saved * 2)
    assert 1 / fused - 1 / measured.linear_flops_per_s(True, 2) == pytest.approx(saved * 2)
    w = Workload(resolve_shape("llama-3-8b"), 65536, lora_rank=16)
    base = planned_options(w, loss_chunks=8)
    placement = estimate_memory(w, base).block_placement
    eager = estimate_time(w, base, rates, placement)
    both = estimate_time(w, (*base, KernelOptions(rms_norm=True, glu_activation=True)), rates, placement)
    assert both.flops == eager.flops and both.seconds < eager.seconds
    # --measure's probe runs the layer's norms and gating through the kernels it is asked for.
    shape = resolve_shape("tiny")
    assert linear_rate(shape, 4, tokens=64, device="cpu", liger_kernels=True) > 0
    assert len(_RMSNorm.calls) == 2 * 4 and len(_SiLUMul.calls) == 4  # 2 norms, 1 gating, 4 runs


@pytest.mark.parametrize(
    "family, runs",
    [("llama", (True, True)), ("gemma3", (True, False)), ("phi3", (True, False)), ("qwen3_moe", (True, False))],
)
def test_auto_and_the_planner_take_each_kernel_only_where_it_runs(monkeypatch, family, runs):
    monkeypatch.setattr(kernels_component, "liger_unusable", lambda: None)
    model = build_family(family)
    chosen = _auto_kernels(model, OffloadConfig(offload_plan="auto")).options(KernelOptions)
    assert (chosen.rms_norm is True, chosen.glu_activation is True) == runs
    both = KernelOptions(rms_norm=True, glu_activation=True)
    assert kernels_component.effective_kernels(model, both) == KernelOptions(*runs)


def test_a_key_that_cannot_run_says_so_under_offload_plan_auto_too(monkeypatch, stand_in):
    monkeypatch.setattr(kernels_component, "liger_unusable", lambda: None)
    model = build_family("gemma3")
    with pytest.warns(UserWarning, match="liger_glu_activation has no effect: the model has no SiLU-gated MLP"):
        run = prepare(model, {"liger_glu_activation": True, "offload_plan": "auto", "seq_len": 64})
    # The run keeps the key as set; the plan counted the gating eager, the norms fused (auto).
    assert run.config.options(KernelOptions) == KernelOptions(rms_norm=True, glu_activation=True)
    assert run.report()["liger_kernels"] == {"rms_norms": 13, "gated_mlps": 0}
    run.close()


def test_applied_after_a_tiled_module_it_refuses_and_prepare_says_why(monkeypatch, stand_in):
    from offloadkit import apply_tiled_mlp

    model = build_llama("tiny")
    tiled = apply_tiled_mlp(model, num_shards=2)
    with pytest.raises(
        ValueError, match="model.layers.0.mlp already has a forward of its own.*apply Liger's kernels first"
    ):
        apply_liger_kernels(model)
    assert all("_offloadkit_liger" not in m.__dict__ for m in model.modules())
    monkeypatch.setattr(kernels_component, "liger_unusable", lambda: None)
    with pytest.warns(UserWarning, match="liger_rms_norm and liger_glu_activation has no effect: .*forward of its own"):
        run = prepare(model, {"liger_rms_norm": True, "liger_glu_activation": True})
    run.close()
    tiled.remove()


def test_offloadkit_plan_counts_the_kernels_where_a_run_would_have_them(monkeypatch, capsys):
    from offloadkit.cli.main import main

    argv = [
        "plan",
        "--shape",
        "llama-3-8b",
        "--lora-rank",
        "16",
        "--seq-len",
        "65536",
        "--gpu-gib",
        "79",
        "--host-gib",
        "100",
        "--disk-gib",
        "100",
    ]
    monkeypatch.setattr(kernels_component, "liger_unusable", lambda: "no GPU")
    assert main(argv) == 0
    without = capsys.readouterr().out
    monkeypatch.setattr(kernels_component, "liger_unusable", lambda: None)
    assert main(argv) == 0
    with_kernels = capsys.readouterr().out
    assert "liger_rms_norm: true" in with_kernels and "liger_rms_norm" not in without


def test_the_final_norm_is_counted_untiled_when_the_tiled_projections_run_in_one_shard():
    w = Workload(resolve_shape("llama-3-8b"), 4096, lora_rank=16)
    one_shard = planned_options(w, mlp_shards=1, tiled_projections=True)
    kernels = dict(footprints(w, (*one_shard, KernelOptions(rms_norm=True))))["kernels"]
    assert kernels.loss == {"final norm": 4096 * (2 * 2 * 4096 + 4)} and kernels.layer_saved == 0


# offload_plan: auto rows with Liger's kernels, PyTorch's default attention kernel
# (benchmarks/capacity.py --probes auto:...), and their eager counterparts, H100 and H200.
MEASURED_ROWS = [
    "liger/h100-9bd14ab/rows/auto-65536-32L-liger.json",
    "liger/h100-9bd14ab/rows/auto-262144-2L-liger.json",
    "compute/h100-3dddea8/rows/auto-65536-32L-liger.json",
    "compute/h100-3dddea8/rows/auto-262144-2L-liger.json",
    "compute/h200-8c50f37/rows/auto-65536-32L-liger.json",
    "compute/h200-8c50f37/rows/auto-262144-2L-liger.json",
    "compute/h100-3dddea8/rows/auto-65536-32L-eager.json",
    "compute/h100-3dddea8/rows/auto-262144-2L-eager.json",
]


@pytest.mark.parametrize("path", MEASURED_ROWS)
def test_the_planned_peak_with_the_kernels_is_what_the_rows_measured(path):
    """The plan each row ran, made again on the row's budgets, predicts its peak allocated
    within 8% above it with Liger's kernels (1.35-1.41x before their backward was counted:
    the gated MLP's gradients written in place, the norm's in 16 bits), and not below it
    without them."""
    import json
    import os

    from offloadkit.longctx.options import LongContextOptions
    from offloadkit.planning import Budgets, plan
    from offloadkit.planning.memory import long_context_counts, long_context_options
    from offloadkit.planning.timing import Rates

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "benchmarks", "results", path)) as fh:
        record = json.load(fh)
    (probe,) = record["probes"]
    config, b = probe["config"], record["budgets"]
    rates = Rates(**{k: v for k, v in b["rates"].items() if k != "source"}, source="measured")
    budgets = Budgets(int(b["gpu_gib"] * GiB), int(b["host_gib"] * GiB), int(b["disk_gib"] * GiB), rates=rates)
    liger = bool(config.get("liger_rms_norm"))
    kernels = (KernelOptions(rms_norm=True, glu_activation=True),) if liger else ()
    p = plan(
        record["shape"], probe["seq_len"], lora_rank=record["lora_rank"], budgets=budgets, layers=probe["layers"],
        fused_lora=config["fused_lora"], options=kernels,
    )  # fmt: skip
    assert p.placement == config["block_input_placement"]
    options = p.options
    long = next(o for o in options if isinstance(o, LongContextOptions))
    chunks, _, projections, groups = long_context_counts(long)
    assert chunks == config["chunked_cross_entropy_num_chunks"]
    # The MLP as it ran (tiled at 256K: the plan now leaves it untiled with the kernels).
    ran = long_context_options(chunks, config.get("tiled_mlp_num_shards") or 1, projections, groups)
    peak = estimate_memory(p.workload, tuple(ran if o is long else o for o in options)).gpu_peak / GiB
    measured = probe["peak_allocated_gib"]
    assert peak >= measured
    if liger:
        assert peak <= 1.08 * measured, f"predicted {peak:.2f} GiB, measured {measured:.2f}"
