"""Liger's fused norm and gated-MLP kernels on the GPU: within bf16 tolerance of the eager
layer (no further from an fp32 reference than the eager bf16 layer is, plus one bf16 step)
on several families, offloading bitwise with them on under slow copies (with the tiled MLP
and the fused LoRA path), the saved bytes the planner counts, and a layer step that runs
faster than the eager one."""

import copy
import statistics
import time

import pytest
import torch

from offloadkit.compose import prepare
from offloadkit.kernels import apply_liger_kernels
from offloadkit.testing import GPU_LAYER_SHAPE, build_llama, make_batch, randomize_lora_b, run_step
from offloadkit.testing.allocations import saved_bytes_in_layer
from offloadkit.testing.families import build_family, family_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("liger_kernel", reason="needs liger-kernel")
peft = pytest.importorskip("peft")

SHAPE = GPU_LAYER_SHAPE
BF16 = 2.0**-8


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _lora(model):
    model.config.use_cache = False
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    randomize_lora_b(model)
    return model.train()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "mistral"])
@pytest.mark.parametrize("lora", [True, False])
def test_within_bf16_tolerance_of_the_eager_layer(family, lora):
    model = build_family(family, "bench", device="cuda", dtype=torch.bfloat16)
    model = _lora(model) if lora else model
    fused = copy.deepcopy(model)
    handle = apply_liger_kernels(fused)
    assert handle.norms and (handle.mlps or family.startswith("gemma"))
    reference = copy.deepcopy(model).float()
    batch = family_batch(family, model, 1024, batch=2, device="cuda")
    loss_e, grads_e = run_step(model, batch)
    loss_f, grads_f = run_step(fused, batch)
    loss_r, grads_r = run_step(reference, batch)
    assert abs(loss_f - loss_r) <= 2 * abs(loss_e - loss_r) + 1e-2 * abs(loss_r)
    for name in grads_e:
        off_fused, off_eager = _rel(grads_f[name], grads_r[name]), _rel(grads_e[name], grads_r[name])
        assert off_fused <= 2 * off_eager + BF16, (name, off_fused, off_eager)
    handle.remove()  # the eager layer again (its forward is deterministic; SDPA's backward is not)
    assert torch.equal(run_step(fused, batch)[0], loss_e)


@pytest.mark.parametrize("tiled", [False, True])
def test_offloading_is_bitwise_with_them_on_under_slow_copies(slow, tiled):
    # Eager attention: SDPA's fused backward kernels may sum in a varying order at this shape.
    torch.manual_seed(0)
    model = _lora(build_llama(SHAPE, dtype=torch.bfloat16, device="cuda", attn_implementation="eager"))
    batch = make_batch(32000, 2, 2048, device="cuda")
    keys = {"liger_rms_norm": True, "liger_glu_activation": True, "fused_lora": True, "gradient_checkpointing": True}
    if tiled:
        keys |= {"tiled_mlp": True, "tiled_mlp_num_shards": 4}
    plain = prepare(copy.deepcopy(model), keys)
    assert plain.report()["liger_kernels"] == {"rms_norms": 5, "gated_mlps": 2}
    expected = run_step(plain.model, batch, plain.context())
    again = run_step(plain.model, batch, plain.context())
    plain.close()
    assert torch.equal(again[0], expected[0]) and all(torch.equal(again[1][n], expected[1][n]) for n in expected[1])
    slow(20_000_000)
    runtime = prepare(model, keys | {"activation_offloading": True})
    got = run_step(model, batch, runtime.context())
    runtime.close()
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(got[1][n], expected[1][n]) for n in expected[1])


def test_a_layer_saves_what_the_planner_counts():
    from offloadkit.component import OptionSet
    from offloadkit.kernels.component import kernels_footprint
    from offloadkit.kernels.options import KernelOptions
    from offloadkit.planning import Workload, resolve_shape
    from offloadkit.planning.plan import planned_options

    torch.manual_seed(0)
    model = _lora(build_llama(SHAPE, dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa"))
    batch = make_batch(32000, 1, 4096, device="cuda")
    # Layer 1: layer 0's input (a frozen embedding's output) needs no gradient, so its input
    # norm saves nothing either way.
    eager = saved_bytes_in_layer(model, batch, 1)
    handle = apply_liger_kernels(model)
    fused = saved_bytes_in_layer(model, batch, 1)
    handle.remove()
    w = Workload(resolve_shape(model.get_base_model()), 4096, lora_rank=16)
    options = (*planned_options(w), KernelOptions(rms_norm=True, glu_activation=True))
    counted = kernels_footprint(w, OptionSet(options)).layer_saved
    # The input norm saves the layer's input, which the planner counts as the block input.
    assert fused - eager == counted + 4096 * SHAPE["hidden_size"] * 2, (fused - eager, counted)


def test_a_layer_step_runs_faster_with_them():
    torch.manual_seed(0)
    model = _lora(build_llama(SHAPE, dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa"))
    batch = make_batch(32000, 1, 16384, device="cuda")

    def timed():
        times = []
        for i in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(**batch).loss.backward()
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        return statistics.median(times)

    eager = timed()
    handle = apply_liger_kernels(model)
    fused = timed()
    handle.remove()
    assert fused < eager, (fused, eager)
