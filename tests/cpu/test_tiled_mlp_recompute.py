"""Under offloadkit's checkpointing, a decoder layer's recompute only harvests what the layer
saves; the tiled MLP of a layer that only adds its output to the residual skips its shards
there (its output is never read) and saves its input as before: gradients bitwise those of the
full recompute, one MLP forward less per step. Everywhere its output may be read, it runs."""

import pytest
import torch

from offloadkit import apply_tiled_mlp
from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch, run_step

LAYERS = 4
SHARDS = 4


def _model():
    torch.manual_seed(0)
    model = build_llama("tiny", num_hidden_layers=LAYERS)
    model.train()
    return model


def _count_down_proj(model) -> list:
    calls = [0]
    for layer in model.model.layers:
        layer.mlp.down_proj.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _step(model, batch, tiled, skip: bool):
    if not skip:
        tiled._unread = set()  # the full recompute, for the reference
    return run_step(model, batch)


@pytest.mark.parametrize("dropped", [(), (2,)], ids=["blocks", "replayed region"])
def test_the_recompute_skips_the_unread_mlp_output_bitwise(dropped):
    batch = make_batch(256, 2, 64)
    results = {}
    for skip in (False, True):
        model = _model()
        calls = _count_down_proj(model)
        tiled = apply_tiled_mlp(model, num_shards=SHARDS)
        checkpointing = apply_activation_checkpointing(model, recompute_inputs=dropped)
        results[skip] = _step(model, batch, tiled, skip)
        results[skip, "calls"] = calls[0]
        results[skip, "skipped"] = tiled.skipped_recomputes
        checkpointing.remove()
        tiled.remove()
    assert_bitwise_equal(results[False][0], results[True][0], "loss")
    assert_bitwise_equal(results[False][1], results[True][1], "grads")
    # Per layer: forward, recompute and backward shards; the recompute's go.
    replays = len(dropped)  # a replayed block runs forward once more in backward, in full
    assert results[False, "calls"] == SHARDS * (3 * LAYERS + replays)
    assert results[True, "calls"] == SHARDS * (2 * LAYERS + replays)
    assert results[True, "skipped"] == LAYERS and results[False, "skipped"] == 0


def test_selective_and_hugging_face_checkpointing_recompute_in_full():
    batch = make_batch(256, 2, 64)
    model = _model()
    tiled = apply_tiled_mlp(model, num_shards=SHARDS)
    checkpointing = apply_activation_checkpointing(model, selective=("mm",))
    run_step(model, batch)
    assert tiled.skipped_recomputes == 0  # its recompute replays cached results in order
    checkpointing.remove()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    run_step(model, batch)
    assert tiled.skipped_recomputes == 0  # not ours: its recompute is not marked
    tiled.remove()


def test_a_layer_that_may_read_the_mlp_output_is_not_skipped():
    model = _model()
    # A class outside the known ones (e.g. a post-MLP norm): the name decides, not a guess.
    for layer in model.model.layers:
        layer.__class__ = type("PostNormDecoderLayer", (type(layer),), {})
    tiled = apply_tiled_mlp(model, num_shards=SHARDS)
    checkpointing = apply_activation_checkpointing(model)
    run_step(model, make_batch(256, 2, 64))
    assert tiled.skipped_recomputes == 0
    checkpointing.remove()
    tiled.remove()
