"""BackwardSGD on the GPU: bitwise equal to torch.optim.SGD (momentum, Nesterov; the default
multi-tensor and the fused kernels; bf16 and fp32 Llamas) with the momentum buffers in pinned
host memory and every state copy delayed, alone and with the layers' weights streamed."""

import pytest
import torch

from offloadkit.layers import apply_layer_streaming
from offloadkit.optim import BackwardSGD
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch
from offloadkit.testing.delays import slow_copies

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")
DEV = "cuda"


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", [{}, {"fused": True}], ids=["default", "fused"])
@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streamed"])
def test_updates_bitwise_equal_to_torch_sgd(dtype, kernel, stream):
    ref = build_llama("small", dtype=dtype, device=DEV)
    ours = build_llama("small", dtype=dtype, device=DEV)
    kw = {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01, **kernel}
    opt_ref = torch.optim.SGD(ref.parameters(), **kw)
    streamer = apply_layer_streaming(ours, trainable=True) if stream else None
    opt = BackwardSGD(ours.parameters(), **kw)
    with slow_copies(2_000_000):
        for step in range(4):
            batch = make_batch(2048, 2, 256, device=DEV, seed=step)
            ref(**batch).loss.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            ours(**batch).loss.backward()
            assert all(p.grad is None for p in ours.parameters())
            opt.step()
    torch.cuda.synchronize()
    assert_bitwise_equal(_params(ref), _params(ours), "weights")
    buf = opt.state[ours.lm_head.weight]["momentum_buffer"]
    assert buf.device.type == "cpu" and buf.is_pinned()
    if streamer is not None:
        assert streamer.collect_stats().write_backs == 4 * ours.config.num_hidden_layers
        streamer.remove()
