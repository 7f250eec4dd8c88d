"""CUDA tests of ``attention_kernel``: every layer's attention runs the named kernel (cuDNN,
flash, efficient, and FA3/FA4 where their builds are installed), in forward and in the
recompute, with checkpoint inputs offloaded and attention outputs kept; the loss is bitwise
that of the same kernel pinned around a plain step, and the gradients within the attention
backward's run-to-run spread (its atomics); ``remove()`` restores PyTorch's choice and torch's
own flash kernel.

Run with ``pytest -m gpu``; skipped without CUDA.
"""

import contextlib

import pytest
import torch

from offloadkit.compose import prepare
from offloadkit.kernels.attention import attention_kernel_unusable, running
from offloadkit.runtime.attention_ops import AttentionCalls
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch, randomize_lora_b

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("clean_cuda"),
]

OPS = {
    "cudnn": "_scaled_dot_product_cudnn_attention",
    "flash": "_scaled_dot_product_flash_attention",
    "fa3": "_scaled_dot_product_flash_attention",
    "fa4": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
}


def _model(kv_heads):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = build_llama(
        "small", dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa", num_hidden_layers=3,
        num_key_value_heads=kv_heads,
    )  # fmt: skip
    model.config.use_cache = False
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    randomize_lora_b(model)
    return model.train()


class _Ops:
    def __init__(self):
        self.names = []

    def __call__(self, op, args, kwargs, run):
        self.names.append(op.__name__.split(".")[0])
        return run()


def _step(model, batch, forward_context, step_context=None):
    """One forward (inside ``forward_context``) and backward (inside ``step_context`` too),
    with every attention kernel call seen (the recompute's, in backward, too)."""
    ops = _Ops()
    with step_context or contextlib.nullcontext(), AttentionCalls(ops):
        with forward_context:
            out = model(**batch)
        out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, ops.names


@pytest.mark.parametrize("kernel", list(OPS))
def test_each_kernel_runs_in_forward_and_recompute_with_offloading_and_kept_outputs(kernel):
    why = attention_kernel_unusable(kernel)
    if why is not None and "probe call" in why:
        pytest.fail(f"{kernel} is installed and fails: {why}")  # not a skip: the provider is here
    if why is not None:
        pytest.skip(f"{kernel}: {why}")
    kv_heads = 8 if kernel == "efficient" else 4  # the efficient kernel takes no grouped keys
    batch = make_batch(2048, 1, 4096, device="cuda")
    # The reference: the same kernel (its provider active through backward) around a plain step.
    loss, grads, ops = _step(_model(kv_heads), batch, contextlib.nullcontext(), running(kernel))
    assert ops == [OPS[kernel]] * 3, ops
    model = _model(kv_heads)
    config = {
        "attention_kernel": kernel,
        "gradient_checkpointing": True,
        "activation_offloading": True,
        "keep_attention_outputs": True,
    }
    runtime = prepare(model, config)
    assert runtime.handles["attention_kernel"] is not None
    assert not [n for n in runtime.notes if "attention_kernel" in n], runtime.notes
    got_loss, got_grads, got_ops = _step(model, batch, runtime.context())
    # Forward only: the kept outputs replace the recompute's kernel call.
    assert got_ops == [OPS[kernel]] * 3, got_ops
    assert_bitwise_equal(loss, got_loss, "loss")
    for name, ref in grads.items():
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(got_grads[name], ref, rtol=0, atol=2e-2 * scale + 1e-12, msg=name)
    runtime.close()
    if kernel in ("fa3", "fa4"):
        from torch.nn.attention import current_flash_attention_impl

        assert current_flash_attention_impl() is None  # torch's own flash kernel again
    model.zero_grad(set_to_none=True)
    _, _, after = _step(model, batch, contextlib.nullcontext())
    assert len(after) == 3


def test_without_kept_outputs_the_recompute_runs_the_forwards_kernel():
    """cuDNN is PyTorch's choice on a Hopper GPU: pinned to flash, the checkpoint's recompute
    must run flash again (saving what the forward saved), not PyTorch's choice."""
    why = attention_kernel_unusable("flash")
    if why is not None:
        pytest.skip(f"flash: {why}")
    model = _model(4)
    runtime = prepare(model, {"attention_kernel": "flash", "gradient_checkpointing": True})
    _, _, ops = _step(model, make_batch(2048, 1, 4096, device="cuda"), runtime.context())
    assert ops == [OPS["flash"]] * 6, ops
    runtime.close()
