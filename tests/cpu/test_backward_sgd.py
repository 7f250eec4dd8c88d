"""BackwardSGD against torch.optim.SGD on the same model and data: every update bitwise equal
(momentum, dampening, Nesterov, weight decay, maximize, two parameter groups, fp32 and bf16,
the default, multi-tensor and fused kernels), with clipping, accumulation and a state_dict
round trip; gradients gone after backward, the momentum buffer on the host; and with the
layers' weights streamed."""

import pytest
import torch
from torch import nn

from offloadkit.optim import BackwardSGD
from offloadkit.testing import assert_bitwise_equal

from .test_backward_adamw import SharedSegments, _batches, _loss, _model, _params  # the same models, data and loss


def _groups(model, lr, **kw):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.01, **kw}, {"params": rest, "weight_decay": 0.0, "lr": lr * 2}]


SETTINGS = {
    "plain": {},
    "momentum": {"momentum": 0.9},
    "dampening": {"momentum": 0.9, "dampening": 0.1},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "maximize": {"momentum": 0.5, "maximize": True},
}
KERNELS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_update_bitwise_equal_to_torch_sgd(setting, kernel, dtype):
    ref, ours = _model(dtype), _model(dtype)
    kw = {**SETTINGS[setting], **KERNELS[kernel]}
    opt_ref = torch.optim.SGD(_groups(ref, 1e-2), lr=1e-2, **kw)
    opt = BackwardSGD(_groups(ours, 1e-2), lr=1e-2, **kw)
    for step, batch in enumerate(_batches(dtype, 4)):
        _loss(ref, batch).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        _loss(ours, batch).backward()
        assert all(p.grad is None for p in ours.parameters()), "updated and freed in backward"
        opt.step()
        assert_bitwise_equal(_params(ref), _params(ours), f"step {step}")
    if kw.get("momentum"):
        buf = opt.state[next(ours.parameters())]["momentum_buffer"]
        assert buf.device.type == "cpu" and buf.dtype == dtype


def test_clipping_accumulation_and_resume():
    ref, ours = _model(torch.float32), _model(torch.float32)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    opt = BackwardSGD(ours.parameters(), lr=1e-2, momentum=0.9, max_grad_norm=0.1)
    batches = _batches(torch.float32, 8)
    for i in range(0, 8, 2):
        for batch in batches[i : i + 2]:
            _loss(ref, batch).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        opt_ref.step()
        opt_ref.zero_grad()
        for batch in batches[i : i + 2]:
            _loss(ours, batch).backward()
        assert all(p.grad is not None for p in ours.parameters()), "clipping defers every update"
        opt.step()
        opt.zero_grad()
        assert_bitwise_equal(_params(ref), _params(ours), f"window {i}")
    # A checkpoint of either optimizer resumes BackwardSGD exactly.
    for saved in (opt.state_dict(), opt_ref.state_dict()):
        again = _model(torch.float32)
        again.load_state_dict(ours.state_dict())
        resumed = BackwardSGD(again.parameters(), lr=1e-2, momentum=0.9)
        resumed.load_state_dict(saved)
        copy_ref = _model(torch.float32)
        copy_ref.load_state_dict(ref.state_dict())
        follow = torch.optim.SGD(copy_ref.parameters(), lr=1e-2, momentum=0.9)
        follow.load_state_dict(opt_ref.state_dict())
        _loss(copy_ref, batches[0]).backward()
        follow.step()
        _loss(again, batches[0]).backward()
        resumed.step()
        assert_bitwise_equal(_params(copy_ref), _params(again), "after resuming")


def test_with_accumulating_context():
    ref, ours = _model(torch.float32), _model(torch.float32)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
    opt = BackwardSGD(ours.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
    batches = _batches(torch.float32, 4)
    for i in range(0, 4, 2):
        _loss(ref, batches[i]).backward()
        _loss(ref, batches[i + 1]).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        with opt.accumulating():
            _loss(ours, batches[i]).backward()
        _loss(ours, batches[i + 1]).backward()
        opt.step()
        assert_bitwise_equal(_params(ref), _params(ours), f"window {i}")


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_with_streamed_layers(kernel):
    pytest.importorskip("transformers")
    from offloadkit.testing import build_llama, make_batch
    from offloadkit.testing.cpu_streaming import stream_layers_on_cpu

    ref, ours = build_llama("tiny"), build_llama("tiny")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9, **KERNELS[kernel])
    streamer = stream_layers_on_cpu(ours, trainable=True)
    opt = BackwardSGD(ours.parameters(), lr=1e-2, momentum=0.9, **KERNELS[kernel])
    for s in range(3):
        batch = make_batch(ref.config.vocab_size, 2, 16, seed=s)
        ref(**batch).loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        ours(**batch).loss.backward()
        opt.step()
    assert streamer.stats.write_backs == 3 * ours.config.num_hidden_layers
    assert_bitwise_equal(_params(ref), _params(ours), "weights")
    streamer.remove()


def test_arguments_are_checked():
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="lr=-1"):
        BackwardSGD(params, lr=-1)
    with pytest.raises(ValueError, match="nesterov=True needs momentum"):
        BackwardSGD(params, nesterov=True)
    with pytest.raises(ValueError, match="max_grad_norm=0"):
        BackwardSGD(params, max_grad_norm=0)


def test_without_momentum_no_state_is_kept():
    model = _model(torch.float32)
    opt = BackwardSGD(model.parameters(), lr=1e-2)
    _loss(model, _batches(torch.float32, 1)[0]).backward()
    opt.step()
    assert dict(opt.state) == {} and opt.state_dict()["state"] == {}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_parameter_in_two_reentrant_checkpoints_is_updated_once(kernel):
    ref, ours = SharedSegments(), SharedSegments()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9, **KERNELS[kernel])
    opt = BackwardSGD(ours.parameters(), lr=1e-2, momentum=0.9, **KERNELS[kernel])
    for step, batch in enumerate(_batches(torch.float32, 3)):
        _loss(ref, batch).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        _loss(ours, batch).backward()
        assert all(p.grad is not None for p in ours.block.parameters()), "waits for its whole gradient"
        opt.step()
        assert_bitwise_equal(_params(ref), _params(ours), f"step {step}")
