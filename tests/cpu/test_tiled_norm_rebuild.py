"""A tiled module fed by a tiled norm (q/k/v after ``input_layernorm``, the MLP after
``post_attention_layernorm``) saves the norm's input, which the norm saves anyway, and
rebuilds its own input in backward over the norm's shards: a layer saves two ``[S, H]``
tensors fewer, with gradients bitwise those of the modules saving their own inputs."""

import pytest
import torch

from offloadkit import apply_tiled_mlp
from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.longctx.shards import Prenorm, shard_bounds
from offloadkit.longctx.tiled_mlp import TiledMLP, tiled_forward
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch, run_step

LAYERS = 3
SHARDS = 3


def _model(lora: bool):
    torch.manual_seed(0)
    model = build_llama("tiny", num_hidden_layers=LAYERS, attn_implementation="sdpa")
    model.config.use_cache = False
    if lora:
        from offloadkit.integrations.peft_utils import apply_lora

        model = apply_lora(model, rank=8)
    model.train()
    return model


def _tiled(model, rebuild: bool):
    tiled = apply_tiled_mlp(model, num_shards=SHARDS, projections=True)
    if not rebuild:
        tiled._norms = set()  # the reference: every module saves its own input
    return tiled


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_rebuilt_norm_outputs_give_bitwise_gradients(lora, checkpointing):
    batch = make_batch(256, 2, 48)
    results = {}
    for rebuild in (False, True):
        model = _model(lora)
        tiled = _tiled(model, rebuild)
        ckpt = apply_activation_checkpointing(model) if checkpointing else None
        results[rebuild] = run_step(model, batch)
        results[rebuild, "rebuilt"] = tiled.rebuilt_inputs
        if ckpt is not None:
            ckpt.remove()
        tiled.remove()
    assert_bitwise_equal(results[False][0], results[True][0], "loss")
    assert_bitwise_equal(results[False][1], results[True][1], "grads")
    # q, k, v and the MLP of every layer, in forward and again in each recompute.
    assert results[True, "rebuilt"] == 4 * LAYERS * (2 if checkpointing else 1)
    assert results[False, "rebuilt"] == 0


def _saved_bytes(model, batch) -> int:
    """Bytes of distinct storages saved for backward inside the decoder layers."""
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out.loss.backward()
    return sum(n for ptr, n in seen.items() if ptr not in params)


def test_a_layer_saves_two_hidden_sized_tensors_fewer():
    batch = make_batch(256, 1, 96)
    hidden = _model(True).config.hidden_size
    saved = {}
    for rebuild in (False, True):
        model = _model(True)
        model.enable_input_require_grads()  # as under checkpointing: layer 0's input is kept
        tiled = _tiled(model, rebuild)
        saved[rebuild] = _saved_bytes(model, batch)
        tiled.remove()
    # Untiled, the final norm and the head save the same in both; per layer the normalised
    # input and the MLP's input are no longer kept.
    assert saved[False] - saved[True] == LAYERS * 2 * 96 * hidden * 4, saved


def _norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * 1.5


@pytest.mark.parametrize("norm_shards,consumer_shards", [(3, 5), (5, 3), (4, 4), (1, 7)])
def test_consumer_shards_straddling_norm_shards(norm_shards, consumer_shards):
    """The consumer's shards need not line up with the norm's: each rebuilt row comes from the
    norm shard forward computed it in."""
    torch.manual_seed(0)
    x = torch.randn(2, 37, 16, requires_grad=True)
    w = torch.randn(16, 24, requires_grad=True)

    def consumer(h):
        return torch.nn.functional.silu(h @ w)

    def run(rebuild):
        xn = tiled_forward(_norm, x, norm_shards)
        if rebuild:
            bounds = shard_bounds(x.numel() // x.shape[-1], norm_shards)
            Prenorm(_norm, bounds).mark(xn, x)
            pre, source = Prenorm.of(xn)
            y = TiledMLP.apply(consumer, consumer_shards, 1, pre, xn, source, w)
        else:
            y = tiled_forward(consumer, xn, consumer_shards, [w])
        loss = (y * torch.linspace(-1, 1, y.shape[-1])).sum()
        gx, gw = torch.autograd.grad(loss, [x, w])
        return y.detach(), gx, gw

    ref, got = run(False), run(True)
    for a, b, what in zip(ref, got, ("output", "input grad", "weight grad")):
        assert_bitwise_equal(a, b, what)


def test_a_view_of_a_norm_output_is_not_taken_for_it():
    x = torch.randn(4, 8, requires_grad=True)
    xn = tiled_forward(_norm, x, 2)
    Prenorm(_norm, shard_bounds(4, 2)).mark(xn, x)
    assert Prenorm.of(xn) is not None
    assert Prenorm.of(xn[1:]) is None and Prenorm.of(xn.view(2, 2, 8)) is None


def test_a_norm_that_writes_its_input_is_refused_at_rebuild():
    def scaling_in_place(x):
        return x.mul_(2.0) if not torch.is_grad_enabled() else x * 2.0

    x = torch.randn(6, 8, requires_grad=True)
    xn = tiled_forward(lambda t: t * 2.0, x, 2)
    Prenorm(scaling_in_place, shard_bounds(6, 2)).mark(xn, x)
    pre, source = Prenorm.of(xn)
    w = torch.randn(8, 8, requires_grad=True)
    y = TiledMLP.apply(lambda h: h @ w, 2, 1, pre, xn, source.detach().clone(), w)
    with pytest.raises(RuntimeError, match="must not write its input in place"):
        y.sum().backward()


def test_an_output_written_in_place_is_not_rebuilt():
    x = torch.randn(6, 8, requires_grad=True)
    xn = tiled_forward(_norm, x, 2)
    Prenorm(_norm, shard_bounds(6, 2)).mark(xn, x)
    with torch.no_grad():
        xn.mul_(2.0)
    assert Prenorm.of(xn) is None  # the consumer saves what it reads
