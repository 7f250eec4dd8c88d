"""Fused attention's outputs kept from forward for the checkpoint's recompute: the kernel runs
once per layer per step instead of twice, gradients bitwise those of the full recompute, the
kernel runs again where storage has no room, and the copies are freed with the graph."""

import gc
import warnings

import pytest
import torch

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.runtime.attention_ops import AttentionCalls
from offloadkit.storage.disk import DiskOptions
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch, run_step

LAYERS = 3

# The tiny model's attention outputs are KiB: above the engine's threshold (min_offload_size,
# 1 KiB), so they go to storage as an 8B layer's GiB would.


def _model():
    torch.manual_seed(0)
    model = build_llama("tiny", num_hidden_layers=LAYERS, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    return model


class _CountKernels:
    """Counts attention kernels that really run (an outer mode sees only the calls the inner
    one passes on)."""

    def __init__(self):
        self.runs = 0

    def __call__(self, op, args, kwargs, run):
        self.runs += 1
        return run()


def _step(keep: bool, storage: str = "ram", tmp_path=None, **kw):
    model = _model()
    extra = {"disk": DiskOptions(directory=str(tmp_path))} if storage == "disk" else {}
    handle = apply_activation_checkpointing(
        model, offload_inputs=True, offload_cpu_tensors=True, storage=storage, keep_attention=keep, **extra, **kw
    )
    counter = _CountKernels()
    with AttentionCalls(counter):
        result = run_step(model, make_batch(256, 2, 64))
    return model, handle, result, counter.runs


@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_the_recompute_takes_the_kept_outputs_bitwise(storage, tmp_path):
    _, ref_handle, ref, ref_runs = _step(False, storage, tmp_path)
    _, handle, got, runs = _step(True, storage, tmp_path)
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert ref_runs == 2 * LAYERS and runs == LAYERS, (ref_runs, runs)
    stats = handle.attention_stats
    assert (stats.kept, stats.replayed, stats.ran_again) == (LAYERS, LAYERS, 0)
    assert stats.kept_bytes > 0
    # Every copy is given back once replayed.
    assert handle.offloader.tier.host_bytes_in_use() == 0 and handle.offloader.tier.bytes_on_disk() == 0
    handle.remove()
    ref_handle.remove()


def test_no_room_runs_the_kernel_again():
    _, handle, got, runs = _step(True, host_budget_bytes=1)
    _, _, ref, _ = _step(False)
    assert_bitwise_equal(ref[1], got[1], "grads")
    stats = handle.attention_stats
    assert stats.kept == 0 and stats.ran_again == LAYERS and runs == 2 * LAYERS
    handle.remove()


def test_a_forward_without_backward_gives_its_copies_back():
    held = {}
    for keep in (False, True):
        model = _model()
        handle = apply_activation_checkpointing(
            model, offload_inputs=True, offload_cpu_tensors=True, keep_attention=keep
        )
        batch = make_batch(256, 2, 64)
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        held[keep, "forward"] = handle.offloader.tier.host_bytes_in_use()
        del out
        gc.collect()
        handle.offloader.drain()  # what the engine's next call does first
        held[keep, "dropped"] = handle.offloader.tier.host_bytes_in_use()
        kept_bytes = handle.attention_stats.kept_bytes
        handle.remove()
    assert kept_bytes > 0 and held[True, "forward"] >= held[False, "forward"] + kept_bytes
    assert held[True, "dropped"] == held[False, "dropped"]


def test_other_shapes_in_the_recompute_run_the_kernel():
    """A recompute that calls attention differently from its forward (here: a block whose
    forward reads state that changed in between) is served by the kernel, not stale bytes."""
    model = _model()
    handle = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True, keep_attention=True)
    attn = model.model.layers[1].self_attn
    calls = {"n": 0}
    original = attn.forward

    def forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the recompute: half the heads' dimension scale changes the kernel's args
            attn.scaling = attn.scaling * 0.5
        return original(*args, **kwargs)

    attn.forward = forward
    batch = make_batch(256, 2, 64)
    model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    stats = handle.attention_stats
    assert stats.ran_again == 1 and stats.replayed == LAYERS - 1
    handle.remove()


def test_keep_attention_without_block_input_offloading_warns_and_recomputes():
    model = _model()
    handle = apply_activation_checkpointing(model, keep_attention=True)
    batch = make_batch(256, 2, 64)
    with pytest.warns(RuntimeWarning, match="keep_attention has no effect"):
        model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    assert handle.attention_stats.kept == 0
    handle.remove()


def test_the_config_route_keeps_them_in_the_whole_model_managers_storage():
    """``prepare()`` offloads block inputs with a whole-model manager: the kept outputs use its
    storage, and the step is bitwise the plain checkpointed one."""
    from offloadkit.compose import prepare

    cfg = {"gradient_checkpointing": True, "activation_offloading": "disk", "keep_attention_outputs": True}
    model = _model()
    runtime = prepare(model, cfg)
    counter = _CountKernels()
    batch = make_batch(256, 2, 64)
    with AttentionCalls(counter):
        with runtime.context():
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert counter.runs == LAYERS and runtime.checkpointing.attention_stats.replayed == LAYERS
    runtime.close()
    ref = _model()
    ref_runtime = prepare(ref, {"gradient_checkpointing": True})
    ref(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    ref_runtime.close()
    assert_bitwise_equal({n: p.grad for n, p in ref.named_parameters()}, grads, "grads")


def test_the_config_route_says_where_keeping_cannot_take_effect():
    """Under Hugging Face's own checkpointing, or without offloading, the key says once that it
    has no effect, and nothing is kept."""
    from offloadkit.compose import prepare

    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.warns(UserWarning, match="keep_attention_outputs has no effect: Hugging Face"):
        runtime = prepare(
            model, {"gradient_checkpointing": True, "activation_offloading": True, "keep_attention_outputs": True}
        )
    assert runtime.checkpointing is None
    runtime.close()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = _model()
        runtime = prepare(model, {"gradient_checkpointing": True, "keep_attention_outputs": True})
        batch = make_batch(256, 1, 32)
        model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    said = [w for w in seen if "keep_attention" in str(w.message)]
    assert len(said) == 1 and "needs gradient_checkpointing" in str(said[0].message)
    assert not runtime.checkpointing.keep_attention
    runtime.close()


def test_an_int_keeps_the_last_layers_only():
    _, ref_handle, ref, _ = _step(False)
    _, handle, got, runs = _step(2)
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert handle.attention_stats.kept == 2 and runs == LAYERS + 1
    handle.remove()
    ref_handle.remove()


def test_the_config_key_takes_true_or_a_layer_count():
    from offloadkit.config import ConfigError, OffloadConfig

    base = {"gradient_checkpointing": True, "activation_offloading": True}
    assert OffloadConfig.from_dict({**base, "keep_attention_outputs": 4}).keep_attention_outputs == 4
    with pytest.raises(ConfigError, match="keep_attention_outputs"):
        OffloadConfig.from_dict({**base, "keep_attention_outputs": "all"})
    with pytest.warns(UserWarning, match="keep_attention_outputs needs gradient_checkpointing"):
        OffloadConfig.from_dict({"keep_attention_outputs": True})


def test_attention_with_dropout_is_not_kept():
    """A kernel with dropout runs again in the recompute: its draws, and every draw after it,
    must be the forward's."""
    model = _model()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    handle = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True, keep_attention=True)
    batch = make_batch(256, 2, 64)
    torch.manual_seed(1)
    model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    stats = handle.attention_stats
    assert stats.kept == 0 and stats.replayed == 0
    handle.remove()


def test_copies_given_up_by_the_collector_are_freed_at_the_next_call():
    model = _model()
    handle = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True, keep_attention=True)
    batch = make_batch(256, 2, 64)
    out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    held = handle.offloader.tier.host_bytes_in_use()
    del out
    gc.collect()
    # Not freed inside the collector: the handles' deaths wait in the engine's queue.
    assert handle.offloader._shared.dead and handle.offloader.tier.host_bytes_in_use() == held
    model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    assert not handle.offloader._shared.dead and handle.offloader.tier.host_bytes_in_use() < held
    handle.remove()
