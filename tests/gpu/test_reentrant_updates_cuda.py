"""Backward optimizers on the GPU where a parameter's gradient comes in pieces: reentrant
checkpointing runs each segment's backward nested in the step's own, on the autograd engine's
device thread. A Llama whose two decoder layers are one module, each layer checkpointed
reentrantly, with the head tied to the embedding: bitwise torch.optim.AdamW, the checkpointed
layers updated at step() and the rest in backward."""

import pytest
import torch

from offloadkit.optim import BackwardAdamW
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")


def _model():
    model = build_llama(
        "small", dtype=torch.bfloat16, device="cuda", attn_implementation="eager", tie_word_embeddings=True
    )
    model.model.layers[1] = model.model.layers[0]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model.train()


@pytest.mark.parametrize("kernel", [{}, {"fused": True}], ids=["default", "fused"])
def test_a_shared_layer_under_reentrant_checkpointing_is_updated_once(kernel):
    ref, ours = _model(), _model()
    batch = make_batch(2048, 2, 256, device="cuda")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, **kernel)
    opt = BackwardAdamW(ours.parameters(), lr=1e-3, **kernel)
    for step in range(3):
        ref(**batch).loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        ours(**batch).loss.backward()
        layers = {id(p) for p in ours.model.layers.parameters()}
        assert all(p.grad is not None for p in ours.model.layers.parameters())  # waiting for step()
        assert all(p.grad is None for p in ours.parameters() if id(p) not in layers)  # updated in backward
        opt.step()
        params = {n: p.detach().clone() for n, p in ref.named_parameters()}
        assert_bitwise_equal(params, {n: p.detach().clone() for n, p in ours.named_parameters()}, f"step {step}")
