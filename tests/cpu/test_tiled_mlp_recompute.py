"""Under offloadkit's checkpointing, a decoder layer's recompute only harvests what the layer
saves; the tiled MLP of a layer that only adds its output to the residual skips its shards
there (its output is never read) and saves its input as before: gradients bitwise those of the
full recompute, one MLP forward less per step. Everywhere its output may be read (a checkpointed
unit of several layers, a forward hook on the MLP), it runs."""

import pytest
import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

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


def _tile(model, skip: bool):
    """The MLPs tiled; without ``skip`` chosen by a predicate, whose modules always recompute in
    full (the same shards: the reference)."""
    if skip:
        return apply_tiled_mlp(model, num_shards=SHARDS)
    return apply_tiled_mlp(model, num_shards=SHARDS, predicate=lambda name, _: name.endswith(".mlp"))


@pytest.mark.parametrize(
    "checkpointing",
    [{}, {"recompute_inputs": (2,)}, {"offload_inputs": True, "offload_cpu_tensors": True, "keep_attention": True}],
    ids=["blocks", "replayed region", "offloaded inputs, kept attention"],
)
def test_the_recompute_skips_the_unread_mlp_output_bitwise(checkpointing):
    batch = make_batch(256, 2, 64)
    results = {}
    for skip in (False, True):
        model = _model()
        calls = _count_down_proj(model)
        tiled = _tile(model, skip)
        handle = apply_activation_checkpointing(model, **checkpointing)
        results[skip] = run_step(model, batch)
        results[skip, "calls"] = calls[0]
        results[skip, "skipped"] = tiled.skipped_recomputes
        handle.remove()
        tiled.remove()
    assert_bitwise_equal(results[False][0], results[True][0], "loss")
    assert_bitwise_equal(results[False][1], results[True][1], "grads")
    # Per layer: forward, recompute and backward shards; the recompute's go.
    replays = len(checkpointing.get("recompute_inputs", ()))  # a replayed block runs forward again, in full
    assert results[False, "calls"] == SHARDS * (3 * LAYERS + replays)
    assert results[True, "calls"] == SHARDS * (2 * LAYERS + replays)
    assert results[True, "skipped"] == LAYERS and results[False, "skipped"] == 0


class _Pair(nn.Module):
    """Two decoder layers checkpointed as one unit: the first one's output feeds the second."""

    def __init__(self, first: nn.Module, second: nn.Module):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, hidden_states, **kwargs):
        return self.second(self.first(hidden_states, **kwargs), **kwargs)


def _paired_model():
    model = _model()
    layers = model.model.layers
    model.model.layers = nn.ModuleList(_Pair(layers[i], layers[i + 1]) for i in range(0, LAYERS, 2))
    model.config.num_hidden_layers = LAYERS // 2
    return model


@pytest.mark.parametrize(
    "unit",
    ["wrapper by block_types", "container by predicate"],
)
def test_a_unit_of_several_layers_recomputes_the_mlp_in_full(unit):
    """Inside the unit's recompute each layer's MLP output is read by the layers after it."""
    batch = make_batch(256, 2, 64)
    results = {}
    for skip in (False, True):
        if unit == "wrapper by block_types":
            model = _paired_model()
            checkpointing = {"block_types": (_Pair,)}
        else:
            model = _model()  # the decoder stack, every layer inside one checkpoint
            checkpointing = {"predicate": lambda name, _: name == "model"}
        tiled = _tile(model, skip)
        handle = apply_activation_checkpointing(model, **checkpointing)
        results[skip] = run_step(model, batch)
        results[skip, "skipped"] = tiled.skipped_recomputes
        handle.remove()
        tiled.remove()
    assert results[True, "skipped"] == 0
    assert_bitwise_equal(results[False][0], results[True][0], "loss")
    assert_bitwise_equal(results[False][1], results[True][1], "grads")


def _gate_hook(module, args, output):
    """Scale the MLP's output by its layer's trainable gate: the product saves the output."""
    return output * module.owner_gate


@pytest.mark.parametrize("where", ["on the mlp", "global"])
def test_a_forward_hook_reading_the_mlp_output_gets_it_computed(where):
    batch = make_batch(256, 2, 64)
    results = {}
    for skip in (False, True):
        model = _model()
        hooks = []
        for layer in model.model.layers:
            layer.gate = nn.Parameter(torch.tensor(1.5))
            object.__setattr__(layer.mlp, "owner_gate", layer.gate)  # not a parameter of the MLP
            if where == "on the mlp":
                hooks.append(layer.mlp.register_forward_hook(_gate_hook))
        if where == "global":
            gated = {id(layer.mlp) for layer in model.model.layers}
            hooks.append(
                register_module_forward_hook(
                    lambda m, a, out, gated=gated: _gate_hook(m, a, out) if id(m) in gated else None
                )
            )
        try:
            tiled = _tile(model, skip)
            handle = apply_activation_checkpointing(model)
            results[skip] = run_step(model, batch)
            results[skip, "skipped"] = tiled.skipped_recomputes
            handle.remove()
            tiled.remove()
        finally:
            for hook in hooks:
                hook.remove()
    assert results[True, "skipped"] == 0
    assert_bitwise_equal(results[False][0], results[True][0], "loss")
    assert_bitwise_equal(results[False][1], results[True][1], "grads")


def test_a_forward_hook_on_the_layer_keeps_the_skip():
    """The checkpoint wraps the layer's forward inside its hooks: they never see the recompute."""
    batch = make_batch(256, 2, 64)
    results = {}
    for skip in (False, True):
        model = _model()
        for layer in model.model.layers:
            layer.gate = nn.Parameter(torch.tensor(1.5))
            layer.register_forward_hook(lambda m, a, out: out * m.gate)
        tiled = _tile(model, skip)
        handle = apply_activation_checkpointing(model)
        results[skip] = run_step(model, batch)
        results[skip, "skipped"] = tiled.skipped_recomputes
        handle.remove()
        tiled.remove()
    assert results[True, "skipped"] == LAYERS
    assert_bitwise_equal(results[False][1], results[True][1], "grads")


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
