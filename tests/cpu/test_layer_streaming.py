"""Frozen-layer streaming bookkeeping, run with CPU "device" memory (the GPU suite runs the
same paths on CUDA with streams)."""

import gc

import pytest
import torch

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.layers import apply_layer_streaming
from offloadkit.storage import HostMemoryBudget
from offloadkit.testing import (
    assert_bitwise_equal,
    build_llama,
    failed_backward,
    lora_llama,
    make_batch,
    randomize_lora_b,
    run_step,
)
from offloadkit.testing.cpu_streaming import stream_layers_on_cpu

peft = pytest.importorskip("peft")


def test_streaming_parity_and_residency_cap():
    model = lora_llama()
    batch = make_batch(2048, 2, 32)
    ref = run_step(model, batch)
    streamer = stream_layers_on_cpu(model, depth=2)
    layers = model.config.num_hidden_layers
    assert len(streamer.layers) == layers and streamer.resident_layers == 0
    for _ in range(3):
        got = run_step(model, batch)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "lora grads")
        assert streamer.resident_layers == 0, "nothing stays resident between steps"
    stats = streamer.stats
    assert stats.max_resident <= 2
    assert stats.misses == 0, "every load must have been issued ahead of need"
    assert stats.loads == 3 * 2 * layers  # once in forward, once in backward, per step
    assert stats.skipped_params["trainable"] > 0  # LoRA adapters stay put
    streamer.remove()


def test_host_copies_hold_exactly_the_streamed_bytes():
    """The plan counts the streamed weights at their own size in the host budget: no growth
    slack, no chunk tails (at 8B they were 2 GiB, one block input less in RAM)."""
    from offloadkit.storage import size_class

    model = lora_llama()
    streamer = stream_layers_on_cpu(model, depth=2)
    assert streamer.pool.bytes_held == sum(size_class(layer.nbytes) for layer in streamer.layers)
    assert streamer.budget.used_bytes == streamer.pool.bytes_held
    streamer.remove()


@pytest.mark.parametrize("depth", [1, 3])
def test_depth_bounds_resident_layers(depth):
    model = lora_llama()
    batch = make_batch(2048, 2, 32)
    ref = run_step(model, batch)
    streamer = stream_layers_on_cpu(model, depth=depth)
    got = run_step(model, batch)
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert streamer.stats.max_resident == depth
    streamer.remove()


def test_streaming_with_checkpointing_shares_one_load_per_layer():
    model = lora_llama()
    model.train()
    batch = make_batch(2048, 2, 32)
    ref = run_step(model, batch)
    ckpt = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True)
    streamer = stream_layers_on_cpu(model)
    got = run_step(model, batch)
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    layers = model.config.num_hidden_layers
    # recompute and backward of a layer share one load: 2 loads per layer per step
    assert streamer.stats.loads == 2 * layers and streamer.stats.misses == 0
    streamer.remove()
    ckpt.remove()


def _residency_at_each_call(model, streamer):
    """Per call of a block's MLP (forward, recompute and region replays alike): whether the
    block's streamed weights were resident and loaded."""
    seen = []
    for i, layer in enumerate(streamer.layers):
        block = model.get_base_model().model.layers[i]
        block.mlp.register_forward_pre_hook(lambda m, a, layer=layer: seen.append(layer.resident and layer.consumed))
    return seen


@pytest.mark.parametrize("wired", [True, False])
def test_recompute_regions_replay_with_the_blocks_resident(wired):
    """A region replaying dropped block inputs runs blocks backward has not reached: the replay
    hook loads them (without it they would run on weights that are not there)."""
    model = lora_llama()
    model.train()
    batch = make_batch(2048, 2, 32)
    ref = run_step(model, batch)
    ckpt = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True, recompute_inputs=[1, 3])
    streamer = stream_layers_on_cpu(model)
    if wired:
        ckpt.register_replay_hook(streamer.make_resident)
    seen = _residency_at_each_call(model, streamer)
    got = run_step(model, batch)
    layers = model.config.num_hidden_layers
    assert len(seen) == 2 * layers + 2  # forward, recompute, and blocks 0 and 2 replayed
    if wired:
        assert all(seen)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "grads")
        assert streamer.stats.max_resident <= 2, "a region of two blocks fits the two resident layers"
    else:
        assert not all(seen)
    streamer.remove()
    ckpt.remove()


def test_hf_checkpointing_with_streaming():
    model = lora_llama()
    batch = make_batch(2048, 2, 32)
    ref = run_step(model, batch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    streamer = stream_layers_on_cpu(model)
    got = run_step(model, batch)
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert streamer.stats.misses == 0
    streamer.remove()


def test_state_dict_and_adapter_saving(tmp_path):
    model = lora_llama("tiny")
    full_ref = {k: v.clone() for k, v in model.state_dict().items()}
    streamer = stream_layers_on_cpu(model)
    run_step(model, make_batch(256, 2, 16))
    full = model.state_dict()
    assert full.keys() == full_ref.keys()
    for k in full_ref:
        assert torch.equal(full[k], full_ref[k]), k
    model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(build_llama("tiny"), tmp_path / "adapter")
    lora_ref = {k: v for k, v in full_ref.items() if "lora" in k}
    lora_new = {k: v for k, v in reloaded.state_dict().items() if "lora" in k}
    assert lora_ref.keys() == lora_new.keys()
    for k in lora_ref:
        assert torch.equal(lora_ref[k], lora_new[k]), k
    streamer.remove()


def test_remove_restores_weights_and_hooks():
    model = lora_llama("tiny")
    hooks_before = {
        id(m): (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._state_dict_hooks)) for m in model.modules()
    }
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    streamer = stream_layers_on_cpu(model)
    run_step(model, make_batch(256, 2, 16))
    streamer.remove()
    hooks_after = {
        id(m): (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._state_dict_hooks)) for m in model.modules()
    }
    assert hooks_before == hooks_after
    for n, p in model.named_parameters():
        assert p.untyped_storage().nbytes() > 0
        if not p.requires_grad:
            assert torch.equal(p.detach(), weights[n]), n
    run_step(model, make_batch(256, 2, 16))  # an ordinary model again


def test_tied_and_shared_weights_are_not_streamed():
    model = lora_llama("tiny")
    base = model.get_base_model()
    shared = base.model.layers[0].mlp.up_proj.base_layer.weight
    base.model.layers[1].mlp.up_proj.base_layer.weight = shared  # one Parameter in two layers
    streamer = stream_layers_on_cpu(model)
    assert streamer.stats.skipped_params["shared"] == 2
    assert shared.untyped_storage().nbytes() > 0
    streamer.remove()


def test_errors_are_clear():
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no.*available|none is available"):
            apply_layer_streaming(lora_llama("tiny"))
    full = build_llama("tiny")  # nothing frozen
    with pytest.raises(ValueError, match="no frozen parameters"):
        stream_layers_on_cpu(full)
    with pytest.raises(ValueError, match="depth"):
        stream_layers_on_cpu(lora_llama("tiny"), depth=0)
    with pytest.raises(ValueError, match="no blocks found"):
        stream_layers_on_cpu(torch.nn.Linear(3, 3))
    tiny_budget = HostMemoryBudget(limit_bytes=1024, min_free_bytes=0)
    with pytest.raises(RuntimeError, match="budget"):
        stream_layers_on_cpu(lora_llama("tiny"), budget=tiny_budget)


def test_forward_without_backward_and_eval():
    model = lora_llama("tiny")
    streamer = stream_layers_on_cpu(model)
    batch = make_batch(256, 2, 16)
    model(**batch)  # graph dropped
    with torch.no_grad():
        model(**batch)
    assert streamer.resident_layers == 0
    streamer.remove()


def test_evicted_weights_read_save_load_and_merge_without_crashing(tmp_path):
    model = lora_llama("tiny")
    batch = make_batch(256, 2, 16)
    base_q = model.base_model.model.model.layers[0].self_attn.q_proj
    original = base_q.base_layer.weight.detach().clone()
    streamer = stream_layers_on_cpu(model)
    run_step(model, batch)
    assert streamer.resident_layers == 0
    # reading an evicted weight gives its value (from the host copy), never a crash
    assert torch.equal(base_q.base_layer.weight, original)
    state = model.state_dict()
    assert torch.equal(state["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"], original)
    # loading new values reaches the host copy and the next forward
    reference = lora_llama("tiny")
    new_state = {k: (v * 0.5 if "layers.1.mlp.up_proj.base_layer" in k else v) for k, v in state.items()}
    model.load_state_dict(new_state)
    reference.load_state_dict(new_state)
    assert_bitwise_equal(run_step(reference, batch)[0], run_step(model, batch)[0], "loss after load_state_dict")
    # PEFT merge / unmerge run with the block resident and write back
    model.merge_adapter()
    reference.merge_adapter()
    assert torch.equal(
        base_q.base_layer.weight, reference.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    )
    with torch.no_grad():  # merged adapters leave nothing trainable in the forward
        assert_bitwise_equal(reference(**batch).loss, model(**batch).loss, "loss after merge")
    model.unmerge_adapter()
    reference.unmerge_adapter()
    assert_bitwise_equal(run_step(reference, batch)[0], run_step(model, batch)[0], "loss after unmerge")
    model.save_pretrained(str(tmp_path / "adapter"))
    assert streamer.resident_layers == 0
    streamer.remove()


def _streamed_with_a_kept_value(key):
    """A streamed tiny LoRA Llama after one step, and a state_dict value taken while evicted
    (an alias of the host copy) with a clone of it."""
    model = lora_llama("tiny")
    streamer = stream_layers_on_cpu(model)
    run_step(model, make_batch(256, 2, 16))
    kept = model.state_dict()[key]
    return model, streamer, kept, kept.clone()


def test_values_taken_while_evicted_outlive_remove_and_then_give_their_host_copy_back():
    model, streamer, kept, expected = _streamed_with_a_kept_value(
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    )
    pool = streamer.pool
    in_use_before = pool.bytes_in_use
    streamer.remove()
    # The layer is resident again; the alias still reads the host copy, which is still held.
    assert pool.bytes_in_use > 0 and torch.equal(kept, expected)
    held = pool.bytes_in_use
    del kept
    gc.collect()
    assert pool.bytes_in_use < held and pool.bytes_in_use == 0, "the last alias gone: its block goes back"
    assert in_use_before > held
    assert pool.budget.used_bytes == pool.bytes_held


def test_values_taken_while_evicted_outlive_the_model_and_streamer_without_remove():
    model, streamer, kept, expected = _streamed_with_a_kept_value(
        "base_model.model.model.layers.1.mlp.up_proj.base_layer.weight"
    )
    pool = streamer.pool
    del model, streamer
    gc.collect()
    assert torch.equal(kept, expected), "the alias keeps its host block (and the chunk under it) alive"
    del kept
    gc.collect()
    assert pool.bytes_in_use == 0


def test_moving_a_streamed_model_is_a_clear_error():
    model = lora_llama("tiny")
    streamer = stream_layers_on_cpu(model)
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match="remove"):
        model(**make_batch(256, 1, 8))
    streamer.remove()


def test_failed_backward_does_not_leave_layers_resident():
    model = lora_llama("small")
    batch = make_batch(2048, 2, 16)
    streamer = stream_layers_on_cpu(model, depth=2)

    out = failed_backward(model, model.base_model.model.model.layers[1], batch)
    del out
    for _ in range(2):
        run_step(model, batch)
        assert streamer.resident_layers == 0, "the end of backward evicts again after a failed pass"
    assert streamer.stats.max_resident <= 2


@pytest.mark.parametrize("how", ["safe_merge", "dora"])
def test_merges_that_replace_weight_data_reach_the_host_copy(how):
    """PEFT's safe_merge, DoRA merges and unmerge assign a new ``.data`` instead of writing in
    place: the streamer adopts it into the flat storage and the host copy."""

    def build():
        config = peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0, use_dora=(how == "dora"))
        model = peft.get_peft_model(build_llama("tiny"), config)
        randomize_lora_b(model)
        return model

    model, reference = build(), build()
    batch = make_batch(256, 2, 16)
    streamer = stream_layers_on_cpu(model)
    run_step(model, batch)
    with torch.no_grad():
        if how == "safe_merge":
            merged, merged_ref = model.merge_and_unload(safe_merge=True), reference.merge_and_unload(safe_merge=True)
        else:
            model.merge_adapter()
            reference.merge_adapter()
            merged, merged_ref = model, reference
        assert_bitwise_equal(merged_ref(**batch).logits, merged(**batch).logits, "logits after merge")
    assert streamer.resident_layers == 0


def test_detached_aliases_of_streamed_weights_are_never_offloaded():
    from offloadkit import get_act_offloading_ctx_manager

    class DetachedLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            return x @ self.lin.weight.detach().t()  # saves an alias with no Parameter base

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(DetachedLinear() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x).tanh()
            return x.sum()

    net = Net().requires_grad_(False)
    x = torch.randn(32, 64, requires_grad=True)
    net(x).backward()
    ref = x.grad.clone()
    x.grad = None
    streamer = stream_layers_on_cpu(net)
    ctx = get_act_offloading_ctx_manager(net, offload_cpu_tensors=True, min_offload_size=0, warn_if_no_head=False)
    with ctx:
        loss = net(x)
    loss.backward()
    assert ctx.stats.kept_by_reason["parameter"] >= 2, "the weight aliases were offloaded"
    torch.testing.assert_close(x.grad, ref, rtol=0, atol=0)
    streamer.remove()


def test_layers_past_the_host_budget_wait_in_files(tmp_path):
    """With a directory, the blocks the budget refuses keep their host copy in a file: the
    step stays bitwise, the budget holds exactly the RAM blocks, reads and saving see the
    real values, and remove() brings every weight back and deletes the files."""
    from offloadkit.storage import size_class

    model = lora_llama()
    batch = make_batch(2048, 2, 32)
    ref = run_step(model, batch)
    values = {k: v.clone() for k, v in model.state_dict().items()}
    one = sum(p.numel() * p.element_size() for p in model.get_base_model().model.layers[0].parameters())
    budget = HostMemoryBudget(limit_bytes=2 * size_class(one + 64 * 1024), min_free_bytes=0)
    streamer = stream_layers_on_cpu(model, depth=2, budget=budget, disk_dir=str(tmp_path))
    layers = model.config.num_hidden_layers
    in_files = [layer for layer in streamer.layers if layer.on_disk]
    assert streamer.stats.disk_layers == len(in_files) == layers - 2
    assert budget.used_bytes == streamer.pool.bytes_held <= budget.limit_bytes  # only the RAM blocks
    [private] = [p for p in tmp_path.iterdir() if p.is_dir()]
    files = sorted(private.glob("*.bin"))
    assert [f.stat().st_size for f in files] == [layer.nbytes for layer in in_files]
    for _ in range(2):
        got = run_step(model, batch)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "lora grads")
    assert_bitwise_equal(values, dict(model.state_dict()), "state_dict read from the files")
    assert streamer.resident_layers == 0 and streamer.stats.misses == 0
    streamer.remove()
    assert not private.exists()
    got = run_step(model, batch)
    assert_bitwise_equal(ref[1], got[1], "grads after remove()")


def test_edits_of_a_resident_file_block_reach_its_file(tmp_path):
    model = lora_llama()
    budget = HostMemoryBudget(limit_bytes=4096, min_free_bytes=0)  # every block to a file
    streamer = stream_layers_on_cpu(model, budget=budget, disk_dir=str(tmp_path))
    weight = model.get_base_model().model.layers[1].mlp.down_proj.base_layer.weight
    before = weight.detach().clone()
    with streamer.resident(1):
        weight.data.mul_(0.5)
    assert streamer.layers[1].on_disk and not streamer.layers[1].resident
    assert_bitwise_equal(before * 0.5, weight.detach().clone(), "evicted weight, read from its file")
    streamer.remove()
    assert_bitwise_equal(before * 0.5, weight.detach().clone(), "after remove()")


def test_a_refused_block_without_a_directory_says_how_to_fix_it():
    tiny_budget = HostMemoryBudget(limit_bytes=1024, min_free_bytes=0)
    with pytest.raises(RuntimeError, match="layer_offloading_dir"):
        stream_layers_on_cpu(lora_llama("tiny"), budget=tiny_budget)


@pytest.mark.parametrize("precision", ["params", "fp32_master"])
def test_trainable_blocks_in_files_update_in_backward_bitwise(tmp_path, precision):
    """A full fine-tune whose blocks all rest in files: BackwardAdamW updates each block while
    it is resident, the eviction writes the update into the file, the next load reads it back.
    Losses and weights bitwise the unstreamed run's over 4 steps; the files hold the weights."""
    from offloadkit.optim import BackwardAdamW

    dtype = torch.bfloat16 if precision == "fp32_master" else torch.float32
    ref, ours = build_llama("tiny", dtype=dtype), build_llama("tiny", dtype=dtype)
    batches = [make_batch(ref.config.vocab_size, 2, 24, seed=s) for s in range(4)]
    budget = HostMemoryBudget(limit_bytes=4096, min_free_bytes=0)
    streamer = stream_layers_on_cpu(ours, trainable=True, budget=budget, disk_dir=str(tmp_path))
    assert streamer.stats.disk_layers == len(streamer.layers) == ours.config.num_hidden_layers
    losses = {}
    for key, model in (("ref", ref), ("ours", ours)):
        opt = BackwardAdamW.for_precision(model.parameters(), precision, lr=1e-3)
        out = []
        for batch in batches:
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.detach().clone())
        losses[key] = torch.stack(out)
    assert_bitwise_equal(losses["ref"], losses["ours"], "losses")
    weights = {n: p.detach().clone() for n, p in ours.named_parameters()}
    assert_bitwise_equal({n: p.detach().clone() for n, p in ref.named_parameters()}, weights, "weights")
    assert streamer.stats.write_backs == 4 * len(streamer.layers)
    layer = streamer.layers[0]
    from_file = torch.from_file(layer.host.path, shared=False, size=layer.nbytes, dtype=torch.uint8)
    assert torch.equal(from_file, layer.host.view(layer.nbytes))  # the file holds the updated bytes
    streamer.remove()
    assert_bitwise_equal(weights, {n: p.detach().clone() for n, p in ours.named_parameters()}, "after remove()")


def test_layer_offloading_dir_is_checked_and_warns_when_off(tmp_path):
    from offloadkit.config import ConfigError, OffloadConfig

    with pytest.raises(ConfigError, match="layer_offloading_dir"):
        OffloadConfig.from_dict({"layer_offloading": True, "layer_offloading_dir": 5})
    a_file = tmp_path / "file"
    a_file.write_text("x")
    config = OffloadConfig.from_dict({"layer_offloading": True, "layer_offloading_dir": str(a_file)})
    with pytest.raises(ConfigError, match="layer_offloading_dir.*is a file"):
        config.check_paths()
    with pytest.warns(UserWarning, match="layer_offloading_dir only applies with layer_offloading"):
        OffloadConfig.from_dict({"layer_offloading_dir": str(tmp_path)})


def test_a_failed_write_of_a_weight_file_fails_its_next_read_instead_of_loading_stale_weights(tmp_path):
    from offloadkit.layers.weight_files import WeightFiles

    files = WeightFiles(str(tmp_path), HostMemoryBudget(), pin_memory=False)
    block = files.block("model.layers.0", 4096)
    block.write_error = OSError(28, "No space left on device")  # as a failed write job leaves it
    with pytest.raises(RuntimeError, match="stale weights"):
        files._read(block, torch.empty(4096, dtype=torch.uint8), None, None, None)
    block.release()
    files.close()
    assert not any(tmp_path.iterdir())
