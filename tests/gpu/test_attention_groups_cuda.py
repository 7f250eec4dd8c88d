"""CUDA tests of attention over key/value head groups: the forward bytes of one whole call,
gradients within the whole call's own run-to-run spread, and the backward's peak lower by
most of the kernel's workspace.

Run with ``pytest -m gpu``; skipped without CUDA.
"""

import gc

import pytest
import torch
import torch.nn.functional as F

from offloadkit.longctx.attention_groups import grouped_attention
from offloadkit.planning import Workload, resolve_shape
from offloadkit.planning.memory import attention_workspace_bytes
from offloadkit.testing import assert_bitwise_equal, assert_equal_as_reruns

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("clean_cuda"),
]

DEV = "cuda"
HQ, HKV, D = 32, 8, 128  # Llama-3-8B's heads


def _qkv(seq, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    # [B, S, H, D] memory seen as [B, H, S, D], as Hugging Face hands them over.
    q = torch.randn(1, seq, HQ, D, device=DEV, dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k = torch.randn(1, seq, HKV, D, device=DEV, dtype=torch.bfloat16, generator=g).transpose(1, 2)
    v = torch.randn(1, seq, HKV, D, device=DEV, dtype=torch.bfloat16, generator=g).transpose(1, 2)
    return [t.detach().requires_grad_() for t in (q, k, v)]


def _run(groups, seq, grad):
    q, k, v = _qkv(seq)
    if groups > 1:
        out = grouped_attention(groups, q, k, v, is_causal=True, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        # torch 2.11's cuDNN backward caches its graph under the inputs' strides, built for the
        # first gradient's strides: the reference always gets its output's own.
        grad = torch.empty_like(out).copy_(grad)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    return out.detach(), dict(zip("qkv", grads))


def _grad(seq, layout):
    """The joined output's gradient: contiguous [B, H, S, D]; [B, S, H, D] memory as a layer's
    output projection hands it back; or a slice of wider rows."""
    if layout == "bhsd":
        return torch.randn(1, HQ, seq, D, device=DEV, dtype=torch.bfloat16)
    if layout == "bshd":
        return torch.randn(1, seq, HQ, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    return torch.randn(1, seq, 2 * HQ, D, device=DEV, dtype=torch.bfloat16)[:, :, :HQ].transpose(1, 2)


@pytest.mark.parametrize("groups", [2, 8])
def test_grouped_forward_is_the_whole_calls_bytes(groups):
    """One process, gradients laid out one way then another for the same inputs: each run's
    gradients are the whole call's, whatever layouts the kernels saw before."""
    seq = 8192
    for layout in ("wide", "bhsd", "bshd", "wide"):
        grad = _grad(seq, layout)
        out, grads = _run(1, seq, grad)
        _, grads_again = _run(1, seq, grad)
        got, got_grads = _run(groups, seq, grad)
        assert_bitwise_equal(out, got, "output")
        how = assert_equal_as_reruns(grads, grads_again, got_grads, f"input gradients ({layout})")
        print(f"groups={groups} {layout}: gradients {how}")


def test_grouped_backward_holds_one_groups_workspace():
    seq = 65536
    grad = _grad(seq, "bshd")  # as a layer hands it back: each group copies its slice (wider rows)
    peaks = {}
    for groups in (1, 8):
        q, k, v = _qkv(seq)
        if groups > 1:
            out = grouped_attention(groups, q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.autograd.grad(out, (q, k, v), grad)
        torch.cuda.synchronize()
        peaks[groups] = torch.cuda.max_memory_allocated() - before
        del q, k, v, out
        gc.collect()
    workspace = attention_workspace_bytes(Workload(resolve_shape("llama-3-8b"), seq))
    saved = peaks[1] - peaks[8]
    print(f"backward peak above the inputs: whole {peaks[1] / 2**30:.2f} GiB, 8 groups {peaks[8] / 2**30:.2f} GiB")
    # The planner counts (1 - 1/8) of the workspace off, less the input gradients (joined once
    # more) and one group's copy of its output gradient.
    assert saved >= workspace * 7 // 8 - seq * (HQ + 2 * HKV) * D * 2 - seq * HQ * D * 2 // 8, (peaks, workspace)
