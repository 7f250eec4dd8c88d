"""What code written for TRL's and torchtune's offloading engines relies on, on CUDA: a bare
``OffloadActivations()`` around a PEFT model's forward, both stream modes on plain layers,
``NoOpManager`` inside an offloading region with backward inside it, the ``tracker`` view of
deduplicated saves, and ``update_model_params``."""

import pytest
import torch
from torch import nn

from offloadkit import NoOpManager, OffloadActivations
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch, randomize_lora_b, run_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"


def test_bare_manager_around_a_peft_model():
    peft = pytest.importorskip("peft")
    model = build_llama("tiny", device=DEV, attn_implementation="eager")
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    randomize_lora_b(model)
    batch = make_batch(256, 2, 64, device=DEV)
    ref = run_step(model, batch)
    ctx = OffloadActivations()  # no model wiring at all
    got = run_step(model, batch, ctx)
    assert ctx.stats.offloaded_tensors > 0
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")


@pytest.mark.parametrize("use_streams", [True, False])
def test_plain_layers_both_stream_modes(use_streams):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 512), nn.ReLU()).to(DEV)
    x = torch.randn(64, 512, device=DEV)
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    ctx = OffloadActivations(use_streams=use_streams)
    with ctx:
        loss = net(x).sum()
    loss.backward()
    assert ctx.stats.offloaded_tensors > 0
    for a, p in zip(ref, net.parameters()):
        assert torch.equal(a, p.grad)


def test_noop_region_with_backward_inside_the_offloading_region():
    model = build_llama("tiny", device=DEV, attn_implementation="eager")
    batch = make_batch(256, 2, 32, device=DEV)
    with OffloadActivations() as ctx:
        first = run_step(model, batch)
        offloaded = ctx.stats.offloaded_tensors
        with NoOpManager():
            second = run_step(model, batch)
    assert offloaded > 0 and ctx.stats.offloaded_tensors == offloaded
    assert_bitwise_equal(first[1], second[1], "grads")


def test_tracker_counts_a_view_and_a_transpose_as_one_copy():
    lin = nn.Linear(256, 256).to(DEV)
    ctx = OffloadActivations(min_offload_size=1)
    ctx.update_model_params(lin)
    assert ctx.param_storages == {p.untyped_storage().data_ptr() for p in lin.parameters()}
    x = torch.randn(64, 256, device=DEV, requires_grad=True)
    with ctx:
        out = lin(x).relu()
        loss = (out.view(-1) * 2).sum() + (out.t() * out.t()).sum()
    copied = [v for v in ctx.tracker.values() if v[1]]
    shared = [v for v in ctx.tracker.values() if not v[1]]
    assert copied and shared and len(ctx.storage_to_tensor_id) < ctx.tensor_id
    loss.backward()
    assert ctx.tracker == {}
