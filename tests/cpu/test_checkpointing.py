"""Block discovery on several architectures, checkpointing parity (full and selective),
block-input offloading, clean removal."""

import pytest
import torch
from torch import nn

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.models import find_blocks
from offloadkit.testing import (
    assert_bitwise_equal,
    build_llama,
    make_batch,
    randomize_lora_b,
    run_step,
)

transformers = pytest.importorskip("transformers")


def _small(cls, **kw):
    return cls(**kw)


ARCHS = {
    "llama": (
        lambda: transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
        ),
        ["model.layers.0", "model.layers.1", "model.layers.2"],
    ),
    "mistral": (
        lambda: transformers.MistralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
        ),
        ["model.layers.0", "model.layers.1"],
    ),
    "qwen2": (
        lambda: transformers.Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
        ),
        ["model.layers.0", "model.layers.1"],
    ),
    "gemma": (
        lambda: transformers.GemmaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=64,
        ),
        ["model.layers.0", "model.layers.1"],
    ),
    "gpt2": (
        lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, bos_token_id=0, eos_token_id=0),
        ["transformer.h.0", "transformer.h.1"],
    ),
    "t5": (
        lambda: transformers.T5Config(
            d_model=32,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=3,
            num_heads=4,
            d_kv=8,
            vocab_size=64,
            decoder_start_token_id=0,
            pad_token_id=0,
        ),
        ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1", "decoder.block.2"],
    ),
}


def _build(arch):
    config = ARCHS[arch][0]()
    if arch == "t5":
        return transformers.T5ForConditionalGeneration(config)
    return transformers.AutoModelForCausalLM.from_config(config)


def _batch(arch):
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    if arch == "t5":
        return {"input_ids": ids, "labels": ids.flip(1).clone()}
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_block_discovery(arch):
    model = _build(arch)
    assert [n for n, _ in find_blocks(model)] == ARCHS[arch][1]


@pytest.mark.parametrize("arch", sorted(set(ARCHS) - {"t5"}))
def test_checkpointing_parity_across_architectures(arch):
    torch.manual_seed(0)
    model = _build(arch)
    model.config.use_cache = False
    model.train()
    batch = _batch(arch)
    for m in model.modules():  # no dropout: compare numbers, not RNG streams
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    plain = run_step(model, batch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf = run_step(model, batch)
    model.gradient_checkpointing_disable()
    handle = apply_activation_checkpointing(model)
    ours = run_step(model, batch)
    handle.remove()
    assert_bitwise_equal(hf[0], ours[0], "loss vs HF checkpointing")
    assert_bitwise_equal(hf[1], ours[1], "grads vs HF checkpointing")
    assert_bitwise_equal(plain[0], ours[0], "loss vs no checkpointing")
    assert_bitwise_equal(plain[1], ours[1], "grads vs no checkpointing")


def test_encoder_decoder_trains_checkpointed():
    # T5's decoder gets a cache object even in training (transformers >= 5.24 passes it as
    # ``cache=``): its cross-attention fills it in forward and would read it back in the
    # recompute, saving 4 tensors fewer. The block must run without it. Dropping the cache
    # changes the decoder's arithmetic (HF's own checkpointing shifts the loss too), so only
    # training is checked here.
    torch.manual_seed(0)
    model = _build("t5").train()
    handle = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True)
    assert len(handle.blocks) == 5
    loss, grads = run_step(model, _batch("t5"))
    assert torch.isfinite(loss) and len(grads) == len(list(model.parameters()))
    assert handle.offloader.stats.offloaded_tensors > 0 and handle.offloader.is_idle()
    handle.remove()


def test_cache_objects_are_dropped_whatever_the_keyword():
    from transformers import DynamicCache

    seen = []

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, kv_store=None, past_key_values=None):
            seen.append((kv_store, past_key_values))
            return self.lin(x)

    model = nn.Sequential(Block(), Block())
    handle = apply_activation_checkpointing(model, block_types=(Block,))
    out = model[1](model[0](torch.randn(2, 4), kv_store=DynamicCache(), past_key_values=object()))
    out.sum().backward()
    # Forward and recompute of block 0 both ran without either cache argument.
    assert seen[0] == (None, None) and len(seen) == 4
    assert all(args == (None, None) for args in seen)
    handle.remove()


def test_explicit_block_types_and_predicate():
    model = build_llama("tiny")
    layer_cls = type(model.model.layers[0])
    assert len(find_blocks(model, block_types=(layer_cls,))) == 2
    names = [n for n, _ in find_blocks(model, predicate=lambda n, m: n.endswith("mlp"))]
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    with pytest.raises(ValueError, match="block_types"):
        find_blocks(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="no blocks found"):
        find_blocks(model, predicate=lambda n, m: False)


def test_custom_model_with_predicate_parity():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4)], nn.Linear(16, 1))
    x = torch.randn(8, 16)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = step()
    handle = apply_activation_checkpointing(model, predicate=lambda n, m: n in {"0", "1", "2", "3"})
    assert len(handle.blocks) == 4
    got = step()
    assert_bitwise_equal(ref[1], got[1], "grads")
    handle.remove()


@pytest.mark.parametrize("selective", [None, ("mm",), ("mm", "attention")])
def test_llama_checkpoint_parity_with_and_without_selective_policy(selective):
    model = build_llama("tiny", attn_implementation="sdpa")
    model.train()
    batch = make_batch(256, 2, 32)
    ref = run_step(model, batch)
    handle = apply_activation_checkpointing(model, selective=selective)
    got = run_step(model, batch)
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    handle.remove()


def test_selective_policy_really_saves_and_recomputes():
    calls = {"mm": 0}
    lin = nn.Linear(32, 32)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x).relu()

    model = nn.Sequential(Block(), Block())
    x = torch.randn(4, 32, requires_grad=True)

    def count_mm(ctx_save):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                    calls["mm"] += 1
                return func(*args, **(kwargs or {}))

        handle = apply_activation_checkpointing(model, block_types=(Block,), selective=ctx_save)
        calls["mm"] = 0
        out = model(x).sum()
        with Count():
            out.backward()
        handle.remove()
        return calls["mm"]

    recompute_all = count_mm(None)
    save_mm = count_mm(("mm",))
    assert save_mm < recompute_all  # saved matmuls are not run again in backward


def test_offload_inputs_parity_and_keeps_last_input():
    model = build_llama("small")
    model.train()
    batch = make_batch(2048, 2, 64)
    ref = run_step(model, batch)
    handle = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True)
    got = run_step(model, batch)
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    stats = handle.offloader.stats
    layers = model.config.num_hidden_layers
    hidden = 2 * 64 * 256 * 4
    # every block input but the last one, plus the keyword inputs the blocks share (attention
    # mask, rotary cos/sin), each moved once however many blocks take it
    shared = 2 * 1 * 64 * 64 * 4 + 2 * (2 * 64 * 16 * 4)
    assert stats.offloaded_tensors == layers - 1 + 3
    assert stats.offloaded_bytes == (layers - 1) * hidden + shared
    assert stats.deduplicated_tensors == 3 * (layers - 2)
    assert stats.prefetch_misses == 0, "a block's inputs come back together, ahead of its recompute"
    assert handle.offloader.is_idle()
    handle.offloader.reset_stats()
    got2 = run_step(model, batch)
    assert_bitwise_equal(ref[1], got2[1], "grads, second step")
    assert handle.offloader.stats.replayed_passes == 1
    assert handle.offloader.stats.prefetch_misses == 0, "inputs must be on their way before recompute needs them"
    handle.remove()


def test_remove_restores_model_and_use_cache():
    model = build_llama("tiny")
    model.config.use_cache = True
    handle = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True)
    assert model.config.use_cache is False
    assert all("forward" in b.__dict__ for _, b in handle.blocks)
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_activation_checkpointing(model)
    handle.remove()
    assert model.config.use_cache is True
    assert all("forward" not in b.__dict__ for _, b in handle.blocks)
    handle.remove()  # idempotent


def test_refuses_double_checkpointing_with_hf():
    model = build_llama("tiny")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        apply_activation_checkpointing(model)


def test_works_with_peft():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_llama("tiny"), peft.LoraConfig(r=4, target_modules="all-linear"))
    randomize_lora_b(model)
    model.train()
    batch = make_batch(256, 2, 32)
    ref = run_step(model, batch)
    handle = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True)
    assert len(handle.blocks) == 2
    got = run_step(model, batch)
    assert_bitwise_equal(ref[1], got[1], "lora grads")
    handle.remove()


def test_eval_mode_is_not_checkpointed():
    model = build_llama("tiny").eval()
    handle = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True)
    with torch.no_grad():
        model(**make_batch(256, 1, 8))
    assert handle.offloader.stats.saved_tensors == 0
    handle.remove()


@pytest.mark.parametrize("linked", [True, False])
def test_last_block_input_stays_on_the_device_under_a_whole_model_manager(tmp_path, linked):
    """The config route (offloadkit checkpointing, a whole-model manager around it) keeps the
    last block's input where it is, as its plan says: backward needs it first, and sending it
    to RAM or disk costs one block input of host or disk space at the end of forward."""
    from offloadkit.compose import prepare

    model = build_llama("tiny")
    batch = make_batch(256, 2, 32)
    ref = run_step(model, batch)
    runtime = prepare(
        model,
        {
            "gradient_checkpointing": True,
            "activation_offloading": "disk",
            "disk_dir": str(tmp_path),
            "min_offload_size": 0,
        },
    )
    if not linked:
        runtime.checkpointing.keep_last_input_from(None)
    blocks = [block for _, block in runtime.checkpointing.blocks]
    inputs = {}

    def seen(i):
        def hook(module, args, kwargs):
            inputs.setdefault(i, args[0] if args else kwargs["hidden_states"])

        return hook

    handles = [b.register_forward_pre_hook(seen(i), with_kwargs=True) for i, b in enumerate(blocks)]
    model.zero_grad(set_to_none=True)
    with runtime.context():
        loss = model(**batch).loss
        kept = {t.data_ptr() for t, offloaded, *_ in runtime.manager.tracker.values() if t is not None}
    assert (inputs[len(blocks) - 1].data_ptr() in kept) == linked
    assert inputs[0].data_ptr() not in kept, "the other block inputs are offloaded"
    loss.backward()
    for h in handles:
        h.remove()
    runtime.close()
    assert_bitwise_equal(ref[0], loss.detach(), "loss")
    assert_bitwise_equal(ref[1], {n: p.grad for n, p in model.named_parameters()}, "grads")


def test_what_is_saved_after_the_last_block_stays_where_it_is():
    """With a whole-model manager, the checkpoints' inputs are offloaded but what the final
    norm and the loss save (backward needs it first) is kept: without that the final norm's
    fp32 input alone would be two more block inputs' worth."""
    from offloadkit.compose import prepare
    from offloadkit.testing import build_llama, make_batch

    model = build_llama("tiny", num_hidden_layers=4, attn_implementation="sdpa")
    model.train()
    runtime = prepare(model, {"gradient_checkpointing": True, "activation_offloading": "disk"})
    batch = make_batch(256, 2, 128)
    with runtime.context():
        loss = model(**batch).loss
    loss.backward()
    stats = runtime.manager.collect_stats()
    block = 2 * 128 * model.config.hidden_size * 4  # fp32 [B, S, H]
    runtime.close()
    # Three offloaded block inputs (the last one is kept), and the rotary tables and position
    # ids passed to each block: less than one block input more.
    assert 3 * block <= stats.offloaded_bytes < 4 * block, (stats.offloaded_bytes, block)
