"""Trainable-layer streaming (a full fine-tune with the blocks' weights in host memory), run
with CPU memory standing in for the device: every update bitwise the unstreamed run's, with
the optimizer updating in backward, after backward (clipping), across accumulation, with
torch's own AdamW, under checkpointing; the host copies hold the updated weights."""

import contextlib

import pytest
import torch

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.optim import BackwardAdamW
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch
from offloadkit.testing.cpu_streaming import stream_layers_on_cpu

pytest.importorskip("transformers")

STEPS = 4


def _pair(dtype=torch.float32):
    ref, ours = build_llama("tiny", dtype=dtype), build_llama("tiny", dtype=dtype)
    return ref, ours


def _batches(n, vocab):
    return [make_batch(vocab, 2, 24, seed=s) for s in range(n)]


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(model, opt, batches, clip=None, accumulate=1):
    losses = []
    for i, batch in enumerate(batches):
        last = (i + 1) % accumulate == 0
        ctx = opt.accumulating() if isinstance(opt, BackwardAdamW) and not last else contextlib.nullcontext()
        with ctx:
            loss = model(**batch).loss
            loss.backward()
        losses.append(loss.detach().clone())
        if last:
            if clip is not None and not isinstance(opt, BackwardAdamW):
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return torch.stack(losses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", ["params", "fp32_master"])
@pytest.mark.parametrize("fused", [False, True], ids=["default", "fused"])
def test_updates_in_backward_are_bitwise_the_unstreamed_run(dtype, precision, fused):
    """The fused kernels write the weights without moving their version counters: the
    optimizer announces its updates, or they would stay behind at eviction."""
    if precision == "fp32_master" and dtype == torch.float32:
        pytest.skip("fp32 parameters keep no master copy")
    ref, ours = _pair(dtype)
    batches = _batches(STEPS, ref.config.vocab_size)
    opt_ref = BackwardAdamW.for_precision(ref.parameters(), precision, lr=1e-3, fused=fused)
    streamer = stream_layers_on_cpu(ours, trainable=True)
    opt = BackwardAdamW.for_precision(ours.parameters(), precision, lr=1e-3, fused=fused)
    layers = ours.config.num_hidden_layers
    assert len(streamer.layers) == layers and streamer.stats.skipped_params == {}
    assert_bitwise_equal(_train(ref, opt_ref, batches), _train(ours, opt, batches), "losses")
    assert streamer.resident_layers == 0
    # Each step's backward updated every block while it was resident, and wrote it back once.
    assert streamer.stats.write_backs == STEPS * layers
    assert_bitwise_equal(_weights(ref), _weights(ours), "weights")
    # The host copies themselves hold the updated weights (what the next load brings in).
    for layer in streamer.layers:
        for slot in layer.slots:
            assert_bitwise_equal(layer.host_tensor(slot), slot.param.detach(), f"host copy of {slot.name}")
    streamer.remove()
    assert_bitwise_equal(_weights(ref), _weights(ours), "weights after remove()")


def test_deferred_updates_and_clipping_write_through_to_the_host_copies():
    """With clipping the updates wait for step(), after every block left: they change the
    evicted weights where they rest, and the next forward loads the updated values."""
    ref, ours = _pair()
    batches = _batches(STEPS, ref.config.vocab_size)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    streamer = stream_layers_on_cpu(ours, trainable=True)
    opt = BackwardAdamW(ours.parameters(), lr=1e-3, max_grad_norm=0.5)
    assert_bitwise_equal(_train(ref, opt_ref, batches, clip=0.5), _train(ours, opt, batches), "losses")
    assert streamer.stats.write_backs == 0, "nothing changed while resident"
    assert_bitwise_equal(_weights(ref), _weights(ours), "weights")
    streamer.remove()


def test_torch_adamw_and_gradient_accumulation():
    ref, ours = _pair()
    batches = _batches(STEPS, ref.config.vocab_size)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    streamer = stream_layers_on_cpu(ours, trainable=True)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    assert_bitwise_equal(_train(ref, opt_ref, batches, accumulate=2), _train(ours, opt, batches, accumulate=2))
    assert_bitwise_equal(_weights(ref), _weights(ours), "weights")
    streamer.remove()


def test_backward_adamw_accumulation_updates_once_per_window():
    ref, ours = _pair()
    batches = _batches(STEPS, ref.config.vocab_size)
    opt_ref = BackwardAdamW(ref.parameters(), lr=1e-3)
    streamer = stream_layers_on_cpu(ours, trainable=True)
    opt = BackwardAdamW(ours.parameters(), lr=1e-3)
    assert_bitwise_equal(_train(ref, opt_ref, batches, accumulate=2), _train(ours, opt, batches, accumulate=2))
    # Only the backward that closes an accumulation window updates (and writes back).
    assert streamer.stats.write_backs == (STEPS // 2) * ours.config.num_hidden_layers
    assert_bitwise_equal(_weights(ref), _weights(ours), "weights")
    streamer.remove()


def test_with_checkpointing_one_load_serves_recompute_and_update():
    ref, ours = _pair()
    batches = _batches(STEPS, ref.config.vocab_size)
    apply_activation_checkpointing(ref)
    apply_activation_checkpointing(ours)
    opt_ref = BackwardAdamW(ref.parameters(), lr=1e-3)
    streamer = stream_layers_on_cpu(ours, trainable=True)
    opt = BackwardAdamW(ours.parameters(), lr=1e-3)
    assert_bitwise_equal(_train(ref, opt_ref, batches), _train(ours, opt, batches), "losses")
    layers = ours.config.num_hidden_layers
    assert streamer.stats.loads == STEPS * 2 * layers
    assert streamer.stats.write_backs == STEPS * layers
    assert_bitwise_equal(_weights(ref), _weights(ours), "weights")
    streamer.remove()


def test_evaluation_and_forward_only_write_nothing_back():
    model = build_llama("tiny")
    streamer = stream_layers_on_cpu(model, trainable=True)
    batch = make_batch(model.config.vocab_size, 2, 16)
    before = _weights(model)
    model.eval()
    with torch.no_grad():
        model(**batch)
    model.train()
    model(**batch)  # a forward whose backward never runs
    assert streamer.stats.write_backs == 0
    assert_bitwise_equal(before, _weights(model), "weights")
    streamer.remove()


def test_frozen_streaming_leaves_trainable_weights_alone():
    model = build_llama("tiny")
    with pytest.raises(ValueError, match="stream trainable weights too"):
        stream_layers_on_cpu(model)
    model.model.layers[0].mlp.requires_grad_(False)
    streamer = stream_layers_on_cpu(model)
    assert len(streamer.layers) == 1 and streamer.stats.skipped_params["trainable"] > 0
    streamer.remove()
