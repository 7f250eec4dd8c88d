"""Drop-and-recompute placement on the GPU: block inputs named in ``recompute_inputs`` are not
offloaded at all; losses and gradients stay bitwise those of checkpoint-input offload, with
every copy delayed; the offloaded bytes fall by exactly the dropped inputs."""

import pytest
import torch

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch
from offloadkit.testing.delays import slow_copies

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")
DEV = "cuda"


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dropped", [[1, 2], [2, 3, 5]])
def test_bitwise_and_fewer_bytes_offloaded(dropped):
    ref = build_llama("small", dtype=torch.bfloat16, device=DEV, num_hidden_layers=6)
    ours = build_llama("small", dtype=torch.bfloat16, device=DEV, num_hidden_layers=6)
    h_ref = apply_activation_checkpointing(ref, offload_inputs=True)
    h_ours = apply_activation_checkpointing(ours, offload_inputs=True, recompute_inputs=dropped)
    batch = make_batch(ref.config.vocab_size, 2, 512, device=DEV)
    expected = _step(ref, batch)
    with slow_copies(2_000_000):
        got = _step(ours, batch)
    assert_bitwise_equal(expected[0], got[0], "loss")
    assert_bitwise_equal(expected[1], got[1], "grads")
    block_input = 2 * 512 * ref.config.hidden_size * 2
    sent = {k: h.offloader.collect_stats().offloaded_bytes for k, h in (("ref", h_ref), ("ours", h_ours))}
    # The last block's input is kept on the GPU either way; every other dropped one is not sent.
    fewer = len([i for i in dropped if i != ref.config.num_hidden_layers - 1])
    assert sent["ref"] - sent["ours"] == fewer * block_input, sent
