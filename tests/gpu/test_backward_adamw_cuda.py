"""BackwardAdamW on the GPU: bitwise equal to torch.optim.AdamW with the same implementation
(the default multi-tensor kernels, the single-tensor loop, the fused kernel) on a bf16 and an
fp32 Llama, moments in pinned host memory, and a peak that holds
neither the gradients nor the moments."""

import pytest
import torch

from offloadkit.optim import BackwardAdamW
from offloadkit.testing import Fp32MasterAdamW, assert_bitwise_equal, build_llama, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")
DEV = "cuda"


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", [{}, {"foreach": False}, {"fused": True}], ids=["default", "single", "fused"])
def test_updates_bitwise_equal_to_torch_adamw(dtype, kernel):
    ref = build_llama("small", dtype=dtype, device=DEV)
    ours = build_llama("small", dtype=dtype, device=DEV)
    batch = make_batch(2048, 2, 256, device=DEV)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, **kernel)
    opt = BackwardAdamW(ours.parameters(), lr=1e-3, **kernel)
    for step in range(3):
        ref(**batch).loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        ours(**batch).loss.backward()
        assert all(p.grad is None for p in ours.parameters())
        opt.step()
        assert_bitwise_equal(_params(ref), _params(ours), f"step {step}")
    state = opt.state[next(ours.parameters())]
    assert state["exp_avg"].is_pinned() and state["exp_avg"].dtype == dtype


@pytest.mark.parametrize("kernel", [{}, {"fused": True}], ids=["default", "fused"])
def test_fp32_master_weights_bitwise_equal_to_adamw_over_fp32_copies(kernel):
    ref = build_llama("small", dtype=torch.bfloat16, device=DEV)
    ours = build_llama("small", dtype=torch.bfloat16, device=DEV)
    batch = make_batch(2048, 2, 256, device=DEV)
    opt_ref = Fp32MasterAdamW(ref, lr=1e-3, **kernel)
    opt = BackwardAdamW(ours.parameters(), lr=1e-3, master_weights=True, **kernel)
    for step in range(3):
        ref(**batch).loss.backward()
        opt_ref.step()
        ours(**batch).loss.backward()
        opt.step()
        assert_bitwise_equal(_params(ref), _params(ours), f"step {step}")
    state = opt.state[next(ours.parameters())]
    assert state["master"].is_pinned() and state["master"].dtype == torch.float32


def test_peak_holds_neither_gradients_nor_moments():
    torch.manual_seed(0)
    model = build_llama("small", dtype=torch.float32, device=DEV, num_hidden_layers=8)
    batch = make_batch(2048, 1, 64, device=DEV)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def peak(make_opt):
        opt = make_opt()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        top = torch.cuda.max_memory_allocated()
        if isinstance(opt, BackwardAdamW):
            opt.remove()
        del opt
        torch.cuda.empty_cache()
        return top

    plain = peak(lambda: torch.optim.AdamW(model.parameters(), lr=1e-4))
    ours = peak(lambda: BackwardAdamW(model.parameters(), lr=1e-4))
    # AdamW holds the gradients and two moments (3x the weights) at its step; in backward
    # only a parameter's own gradient and moments are on the GPU at a time.
    assert plain - ours >= 2 * weights, (plain, ours, weights)
