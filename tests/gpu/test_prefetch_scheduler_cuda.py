"""One prefetch scheduler on the GPU: saved activations, streamed weights and optimizer state
fetch ahead through one scheduler and its shared byte window, on the process's two copy
streams. Bitwise the run without offloading, with every copy delayed by milliseconds, on a
side stream; everything fetched ahead is used or dropped by the end of each step, and the
window is never exceeded."""

import pytest
import torch

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.layers import apply_layer_streaming
from offloadkit.optim import BackwardAdamW
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch, randomize_lora_b, run_step
from offloadkit.testing.delays import slow_copies
from offloadkit.transfer import PrefetchScheduler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
peft = pytest.importorskip("peft")
DEV = "cuda"
SLOW = 2_000_000  # GPU cycles before each copy: about a millisecond


def _lora(layers=6):
    model = build_llama("small", dtype=torch.bfloat16, device=DEV, num_hidden_layers=layers)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    randomize_lora_b(model)
    model.train()
    return model


@pytest.mark.parametrize("window_layers", [None, 1.5], ids=["unbounded", "window-1.5-layers"])
def test_activations_and_weights_bitwise_through_one_window(window_layers):
    model = _lora()
    batch = make_batch(2048, 2, 512, device=DEV)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = run_step(model, batch)
    model.gradient_checkpointing_disable()
    scheduler = PrefetchScheduler()
    ckpt = apply_activation_checkpointing(model, offload_inputs=True, max_fwd_stash_size=1, scheduler=scheduler)
    streamer = apply_layer_streaming(model, scheduler=scheduler)
    if window_layers is not None:
        scheduler.window_bytes = int(window_layers * streamer.layers[0].nbytes)
    with slow_copies(SLOW):
        for _ in range(2):
            got = run_step(model, batch)
            assert_bitwise_equal(ref[0], got[0], "loss")
            assert_bitwise_equal(ref[1], got[1], "lora grads")
            assert scheduler.pending_bytes == 0
    stats = scheduler.stats()
    assert stats["activations"]["fetched"] > 0 and stats["weights"]["fetched"] > 0
    if window_layers is None:
        assert streamer.stats.misses == 0 and ckpt.offloader.collect_stats().prefetch_misses == 0
    else:
        assert scheduler.peak_pending_bytes <= scheduler.window_bytes
        assert stats["activations"]["held_back"] + stats["weights"]["held_back"] > 0
    assert streamer.resident_layers == 0 and ckpt.offloader.is_idle()
    streamer.remove()
    ckpt.remove()


def test_full_fine_tune_state_weights_and_activations_share_the_scheduler():
    """A streamed full fine-tune: BackwardAdamW's state, the trainable blocks' weights and the
    block inputs are three lanes of one scheduler; 3 steps bitwise the unstreamed run."""
    ref = build_llama("small", dtype=torch.bfloat16, device=DEV)
    ours = build_llama("small", dtype=torch.bfloat16, device=DEV)
    batches = [make_batch(ref.config.vocab_size, 2, 256, device=DEV, seed=s) for s in range(3)]
    apply_activation_checkpointing(ref)
    opt_ref = BackwardAdamW.for_precision(ref.parameters(), "fp32_master", lr=1e-3)
    scheduler = PrefetchScheduler()
    ckpt = apply_activation_checkpointing(ours, offload_inputs=True, max_fwd_stash_size=1, scheduler=scheduler)
    streamer = apply_layer_streaming(ours, trainable=True, scheduler=scheduler)
    opt = BackwardAdamW.for_precision(ours.parameters(), "fp32_master", lr=1e-3, scheduler=scheduler)
    losses = {"ref": [], "ours": []}
    with slow_copies(SLOW):
        for batch in batches:
            for key, model, o in (("ref", ref, opt_ref), ("ours", ours, opt)):
                loss = model(**batch).loss
                loss.backward()
                o.step()
                o.zero_grad(set_to_none=True)
                losses[key].append(loss.detach().clone())
    torch.cuda.synchronize()
    assert_bitwise_equal(torch.stack(losses["ref"]), torch.stack(losses["ours"]), "losses")
    assert_bitwise_equal(
        {n: p.detach().clone() for n, p in ref.named_parameters()},
        {n: p.detach().clone() for n, p in ours.named_parameters()},
        "weights",
    )
    stats = scheduler.stats()
    assert {"activations", "weights", "optimizer state"} <= set(stats)
    assert stats["weights"]["fetched"] > 0 and stats["optimizer state"]["fetched"] > 0
    assert stats["activations"]["fetched"] > 0
    assert scheduler.pending_bytes == 0  # every fetch ahead was used, or released by step()
    streamer.remove()
    ckpt.remove()
