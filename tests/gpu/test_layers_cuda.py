"""CUDA tests of checkpoint-input offloading and frozen-layer streaming.

Run with ``pytest -m gpu`` on a machine with a GPU; skipped without CUDA.
"""

import gc

import pytest
import torch

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.engine.stats import WaitClock
from offloadkit.layers import apply_layer_streaming
from offloadkit.testing import (
    assert_bitwise_equal,
    build_llama,
    make_batch,
    memory_after_each_step,
    randomize_lora_b,
    run_step,
    step_on_side_stream,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
peft = pytest.importorskip("peft")

DEV = "cuda"
SLOW = 20_000_000  # device-side sleep before each copy: ~10 ms, longer than a layer here


def lora_llama(layers=6, seq=512):
    model = build_llama("small", dtype=torch.bfloat16, device=DEV, num_hidden_layers=layers)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    randomize_lora_b(model)
    model.train()
    return model, make_batch(2048, 2, seq, device=DEV)


def reference(model, batch):
    """Plain (HF) checkpointing, run twice to prove the reference itself is deterministic."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    a, b = run_step(model, batch), run_step(model, batch)
    model.gradient_checkpointing_disable()
    assert_bitwise_equal(a[1], b[1], "reference determinism")
    return a


@pytest.mark.parametrize("input_offload, stream", [(False, False), (True, False), (False, True), (True, True)])
def test_parity_checkpointing_input_offload_layer_streaming(input_offload, stream):
    model, batch = lora_llama()
    ref = reference(model, batch)
    ckpt = apply_activation_checkpointing(model, offload_inputs=input_offload)
    streamer = apply_layer_streaming(model) if stream else None
    for _ in range(2):
        got = run_step(model, batch)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "lora grads")
    if input_offload:
        st = ckpt.offloader.collect_stats()
        assert st.offloaded_tensors >= 2 * (model.config.num_hidden_layers - 1)  # + shared keyword inputs
        assert st.prefetch_misses == 0 and ckpt.offloader.is_idle()  # a block's inputs come back together
    if streamer is not None:
        assert streamer.stats.misses == 0 and streamer.stats.max_resident <= 2
        assert streamer.resident_layers == 0
        streamer.remove()
    ckpt.remove()


def test_races_slow_copies_and_non_default_stream(slow):
    model, batch = lora_llama()
    ref = reference(model, batch)
    ckpt = apply_activation_checkpointing(model, offload_inputs=True)
    slow(SLOW)
    streamer = apply_layer_streaming(model)
    got = step_on_side_stream(run_step, model, batch)
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "lora grads")
    assert streamer.collect_stats().wait_seconds > 0, "slow weight copies must show as waits"
    streamer.remove()
    ckpt.remove()


def test_recompute_regions_with_streaming_and_slow_copies(slow):
    """Dropped block inputs replayed in backward run blocks backward has not reached yet: the
    replay hook loads their weights (and waits for the copy) first. Bitwise, with every copy
    slowed, on a side stream; the two-block regions fit the two resident layers."""
    model, batch = lora_llama()
    ref = reference(model, batch)
    ckpt = apply_activation_checkpointing(model, offload_inputs=True, recompute_inputs=[1, 3])
    slow(SLOW)
    streamer = apply_layer_streaming(model)
    ckpt.register_replay_hook(streamer.make_resident)
    for _ in range(2):
        got = step_on_side_stream(run_step, model, batch)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "lora grads")
    stats = streamer.collect_stats()
    assert stats.max_resident <= 2 and streamer.resident_layers == 0 and stats.wait_seconds > 0
    streamer.remove()
    ckpt.remove()


def test_streaming_race_detector_catches_a_missing_wait(monkeypatch, slow):
    """Negative control: without the compute stream's wait on weight copies, numbers break."""
    model, batch = lora_llama()
    ref = reference(model, batch)
    streamer = apply_layer_streaming(model, depth=1)
    slow(SLOW * 5)
    monkeypatch.setattr(WaitClock, "wait", lambda self, stream, event, phase, stats: None)
    got = run_step(model, batch)
    torch.cuda.synchronize()
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_bitwise_equal(ref[1], got[1], "grads")
    streamer.remove()


def test_gpu_memory_after_setup_is_non_layer_params_plus_pool():
    gc.collect()
    torch.cuda.synchronize()
    before_model = torch.cuda.memory_allocated()
    model, batch = lora_llama(layers=8)
    batch_bytes = sum(t.numel() * t.element_size() for t in batch.values())
    torch.cuda.synchronize()
    streamer = apply_layer_streaming(model, depth=2)
    streamed = {id(s.param) for layer in streamer.layers for s in layer.slots}
    non_layer = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in streamed)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    pool = 2 * max(layer.nbytes for layer in streamer.layers)
    after_setup = torch.cuda.memory_allocated() - before_model - batch_bytes
    assert after_setup <= non_layer + buffers + pool
    assert after_setup <= non_layer + buffers + (1 << 20)  # nothing resident yet
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run_step(model, batch)
    run_step(model, batch)
    # weights never exceed the pool: the rest of the step's peak is activations and grads,
    # bounded by what the same step needs with every weight resident
    assert streamer.stats.max_resident <= 2
    lora_grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert torch.cuda.memory_allocated() - base <= lora_grads + (1 << 20)  # no weights stay resident
    streamer.remove()


def test_hundred_steps_flat_memory_with_everything_on():
    gc.collect()
    model, batch = lora_llama(layers=4, seq=256)
    ckpt = apply_activation_checkpointing(model, offload_inputs=True)
    streamer = apply_layer_streaming(model)
    pool_allocs = []

    def check():
        assert ckpt.offloader.is_idle() and streamer.resident_layers == 0
        pool_allocs.append(ckpt.offloader.pool.allocations)

    allocated, rss = memory_after_each_step(model, batch, 100, check=check)
    assert len(set(allocated[5:])) == 1, f"GPU memory drifts: {sorted(set(allocated[5:]))[:4]}"
    assert rss[-1] - rss[5] < 64 << 20, f"host RSS grew {(rss[-1] - rss[5]) >> 20} MiB"
    assert pool_allocs[-1] == pool_allocs[1], "pinned buffers must be reused once warm"
    streamer.remove()
    ckpt.remove()


def test_state_dict_on_gpu_matches_original():
    model, batch = lora_llama(layers=2)
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    streamer = apply_layer_streaming(model)
    run_step(model, batch)
    after = model.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k].detach().cpu()), k
    streamer.remove()
    for k, v in model.state_dict().items():
        assert v.device.type == "cuda" and torch.equal(before[k], v.cpu()), k


def test_evicted_weights_stay_usable_on_the_gpu(tmp_path):
    """Evicted weights alias their pinned host copy on the GPU: the Trainer's model.to("cuda")
    moves nothing, reads and PEFT merges see and change the real values, nothing crashes."""
    model, batch = lora_llama()
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    original = q.base_layer.weight.detach().clone()
    streamer = apply_layer_streaming(model)
    run_step(model, batch)
    before = torch.cuda.memory_allocated()
    model.to("cuda")  # what the Trainer does: must not bring every frozen weight back
    assert torch.cuda.memory_allocated() == before
    w = q.base_layer.weight
    assert w.device.type == "cuda" and torch.equal(w, original)
    assert torch.equal(
        model.state_dict()["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"], original
    )
    with torch.no_grad():
        plain = model(**batch).loss
        model.merge_adapter()
        merged = model(**batch).loss
        model.unmerge_adapter()
        again = model(**batch).loss
    torch.testing.assert_close(plain, merged, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(plain, again, rtol=1e-2, atol=1e-2)  # unmerge restores within bf16 rounding
    model.save_pretrained(str(tmp_path / "adapter"))
    assert streamer.resident_layers == 0
    streamer.remove()


def test_gpu_aliases_kept_after_remove_stay_readable_then_free_their_host_copy():
    """A state_dict value taken while a layer is evicted aliases the pinned host copy on the GPU.
    It must stay valid after remove() and after the streamer is garbage-collected (the alias
    holds the host block), and the block must go back once the alias is dropped."""
    model, batch = lora_llama()
    streamer = apply_layer_streaming(model)
    run_step(model, batch)
    key = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    kept = model.state_dict()[key]
    assert kept.device.type == "cuda"
    expected = kept.clone()
    pool = streamer.pool
    streamer.remove()
    del streamer
    gc.collect()
    torch.cuda.synchronize()
    assert torch.equal(kept * 1, expected), "the GPU reads the host copy the alias keeps alive"
    assert pool.bytes_in_use > 0
    del kept
    gc.collect()
    assert pool.bytes_in_use == 0 and pool.bytes_held == 0, "closed pool: the last block back frees its chunk"


def test_layers_in_files_past_the_budget_bitwise_with_slow_copies(tmp_path, slow):
    """Blocks the host budget refuses stream from files: read on an I/O thread into pinned
    staging, copied in on the host->device stream. Bitwise, with every copy slowed, on a side
    stream; every file block read once per pass and direction."""
    from offloadkit.storage import HostMemoryBudget, size_class

    model, batch = lora_llama()
    ref = reference(model, batch)
    ckpt = apply_activation_checkpointing(model, offload_inputs=True)
    one = sum(p.numel() * p.element_size() for p in model.get_base_model().model.layers[0].parameters())
    budget = HostMemoryBudget(limit_bytes=2 * size_class(one + (64 << 10)), min_free_bytes=0)
    streamer = apply_layer_streaming(model, budget=budget, disk_dir=str(tmp_path))
    slow(SLOW)
    layers = model.config.num_hidden_layers
    assert streamer.stats.disk_layers == layers - 2
    for _ in range(2):
        got = step_on_side_stream(run_step, model, batch)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "lora grads")
    stats = streamer.collect_stats()
    file_bytes = sum(layer.nbytes for layer in streamer.layers if layer.on_disk)
    assert stats.disk_read_bytes == 2 * 2 * file_bytes  # forward and backward, two steps
    assert stats.misses == 0 and stats.max_resident <= 2 and streamer.resident_layers == 0
    streamer.remove()
    ckpt.remove()
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]
