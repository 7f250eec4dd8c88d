"""Selective checkpointing on the GPU, as a plan for a full fine-tune turns it on: each layer's
matmul and attention outputs saved (``selective_checkpointing: [mm, attention]``) beside
block-input offload, through ``prepare()``. Saved outputs are the bytes the recompute would
make again, so losses, gradients and BackwardAdamW's updates are bitwise those of checkpointing
without it; attention runs SDPA's math kernel here, whose backward reproduces itself."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from offloadkit.compose import prepare
from offloadkit.optim import BackwardAdamW
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch, run_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")
DEV = "cuda"
BASE = {"gradient_checkpointing": True, "activation_offloading": True}
SAVED = {**BASE, "selective_checkpointing": ["mm", "attention"]}


def _model():
    torch.manual_seed(0)
    model = build_llama("small", dtype=torch.bfloat16, device=DEV, attn_implementation="sdpa", num_hidden_layers=4)
    model.config.use_cache = False
    return model.train()


def test_saved_outputs_give_the_gradients_of_a_full_recompute():
    batch = make_batch(2048, 2, 512, device=DEV)
    results = {}
    for name, config in (("recompute", BASE), ("saved", SAVED)):
        model = _model()
        runtime = prepare(model, config)
        try:
            assert runtime.config.to_dict()["selective_checkpointing"] == config.get("selective_checkpointing")
            with sdpa_kernel(SDPBackend.MATH):
                results[name] = run_step(model, batch, ctx=runtime.context())
            results[name, "offloaded"] = runtime.report()["activations"]["offloaded_tensors"]
        finally:
            runtime.close()
    assert_bitwise_equal(results["recompute"][0], results["saved"][0], "loss")
    assert_bitwise_equal(results["recompute"][1], results["saved"][1], "grads")
    assert results["recompute", "offloaded"] > 0 and results["saved", "offloaded"] > 0  # block inputs moved


def test_backward_adamw_updates_bitwise_with_saved_outputs():
    """fp32 master weights updated in backward, as the planned 3B ran: the parameters after
    two steps are the same bits with and without the saved outputs."""
    batch = make_batch(2048, 1, 512, device=DEV)
    params = {}
    for name, config in (("recompute", BASE), ("saved", SAVED)):
        model = _model()
        runtime = prepare(model, config)
        opt = BackwardAdamW(model.parameters(), lr=1e-3, master_weights=True)
        try:
            for _ in range(2):
                with sdpa_kernel(SDPBackend.MATH):  # the recompute in backward runs the same kernel
                    with runtime.context():
                        loss = model(**batch).loss
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            params[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            runtime.close()
    assert_bitwise_equal(params["recompute"], params["saved"], "parameters after two steps")
