"""CUDA tests of the chunked loss and the tiled MLP: bf16 parity, peak memory, a loss past
2**31 logits elements, and composition with checkpoint-input offloading and layer streaming.

Run with ``pytest -m gpu`` on a GPU with at least 40 GB; skipped without CUDA.

bf16 tolerance: the chunked or tiled result must be no further from a high-precision
reference than twice the unchunked/untiled bf16 result is, plus 1e-3 (relative to the
reference's largest value).
"""

import gc

import pytest
import torch
import torch.nn.functional as F

from offloadkit import apply_chunked_loss, apply_tiled_mlp, chunked_cross_entropy
from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.layers import apply_layer_streaming
from offloadkit.longctx.tiled_mlp import tiled_forward
from offloadkit.testing import (
    assert_bitwise_equal,
    assert_equal_as_reruns,
    build_llama,
    make_batch,
    randomize_lora_b,
    run_step,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("clean_cuda"),
]

DEV = "cuda"
GIB = 2**30
VOCAB = 128256


def peak(fn):
    """(result, bytes allocated at the peak of ``fn`` above what was allocated before)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def rel_err(got, exact):
    return ((got.double() - exact.double()).abs().max() / exact.double().abs().max()).item()


def no_worse(got, ref, exact, what, factor=2.0, slack=1e-3):
    e_got, e_ref = rel_err(got, exact), rel_err(ref, exact)
    assert e_got <= factor * e_ref + slack, f"{what}: {e_got:.2e} vs unchunked/untiled {e_ref:.2e}"


def loss_problem(tokens, hidden, vocab, seed=0, head_grad=True):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = torch.randn(1, tokens, hidden, device=DEV, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device=DEV, generator=g) / hidden**0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (1, tokens), device=DEV, generator=g)
    labels[0, : tokens // 8] = -100
    return h.requires_grad_(), w.requires_grad_(head_grad), labels


def unchunked(h, w, labels):
    logits = F.linear(h, w)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.view(-1, w.shape[0]), shifted.reshape(-1))


def test_bf16_parity_against_fp64():
    h, w, labels = loss_problem(8192, 2048, 32000)
    exact_in = [t.detach().double().requires_grad_() for t in (h, w)]
    exact = unchunked(*exact_in, labels)
    exact.backward()
    ref_in = [t.detach().clone().requires_grad_() for t in (h, w)]
    ref = unchunked(*ref_in, labels)
    ref.backward()
    got = chunked_cross_entropy(h, w, labels, num_chunks=7)
    got.backward()
    no_worse(got, ref, exact, "loss")
    no_worse(h.grad, ref_in[0].grad, exact_in[0].grad, "hidden grad")
    no_worse(w.grad, ref_in[1].grad, exact_in[1].grad, "weight grad")


def test_peak_memory_16k_tokens_128k_vocab_frozen_head():
    """The 8B LoRA case: 16K tokens, 128256 vocab, hidden 4096, frozen head. Full logits are
    3.9 GiB in bf16 and 7.8 GiB in fp32; the chunked loss holds one ~1 GiB chunk."""
    tokens, hidden = 16384, 4096
    h, w, labels = loss_problem(tokens, hidden, VOCAB, head_grad=False)
    fp32_logits = tokens * VOCAB * 4

    def chunked_step():
        loss = chunked_cross_entropy(h, w, labels)
        loss.backward()
        return loss.detach()

    got, got_peak = peak(chunked_step)
    grad_chunked = h.grad
    h.grad = None

    def reference_step():
        loss = unchunked(h, w, labels)
        loss.backward()
        return loss.detach()

    ref, ref_peak = peak(reference_step)
    assert w.grad is None
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=0)
    assert rel_err(grad_chunked, h.grad) < 2e-2
    assert got_peak < 2.5 * GIB, f"chunked peak {got_peak / GIB:.2f} GiB"
    assert got_peak < 0.35 * fp32_logits
    assert got_peak * 5 < ref_peak, f"chunked {got_peak / GIB:.2f} GiB vs unchunked {ref_peak / GIB:.2f} GiB"


def test_past_two_to_the_31_logits_elements():
    """20480 tokens x 128256 vocab = 2.63e9 logits elements, hidden 4096, trainable head,
    against an fp64 reference computed in chunks on the GPU from the same bf16 inputs."""
    tokens, hidden = 20480, 4096
    assert tokens * VOCAB > 2**31
    h, w, labels = loss_problem(tokens, hidden, VOCAB)
    labels[0, -3000:-2000] = -100  # ignored tokens past the 2**31-th logit too

    def chunked_step():
        loss = chunked_cross_entropy(h, w, labels)
        loss.backward()
        return loss.detach()

    got, got_peak = peak(chunked_step)
    # Gradient buffers (hidden and the fp32 weight accumulator, then the bf16 weight grad)
    # plus one chunk's logits.
    grads = h.numel() * 2 * 2 + w.numel() * (4 + 4 + 2)
    assert got_peak < grads + 2.5 * GIB, f"peak {got_peak / GIB:.2f} GiB"

    h64, w64 = h.detach().double(), w.detach().double()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    valid = shifted != -100
    count = valid.sum()
    total = torch.zeros((), dtype=torch.float64, device=DEV)
    grad_h = torch.zeros_like(h64[0])
    grad_w = torch.zeros_like(w64)
    for start in range(0, tokens, 1024):
        rows = slice(start, start + 1024)
        logp = torch.log_softmax(h64[0, rows] @ w64.t(), dim=-1)
        lab, ok = shifted[rows], valid[rows]
        total -= logp.gather(1, lab.clamp(min=0)[:, None])[:, 0][ok].sum()
        d = logp.exp_()
        d[torch.arange(d.shape[0], device=DEV)[ok], lab[ok]] -= 1
        d *= ok[:, None] / count
        grad_h[rows] = d @ w64
        grad_w.addmm_(d.t(), h64[0, rows])
        del logp, d
    exact = total / count
    assert abs(got.item() - exact.item()) / exact.item() < 5e-3
    assert rel_err(h.grad[0], grad_h) < 2e-2
    assert rel_err(w.grad, grad_w) < 2e-2
    tail = slice(tokens - 1000, tokens)  # rows whose logits start past element 2**31
    assert rel_err(h.grad[0, tail], grad_h[tail]) < 2e-2


def lora_model(layers=2, **shape):
    peft = pytest.importorskip("peft")
    model = build_llama("small", dtype=torch.bfloat16, device=DEV, num_hidden_layers=layers, **shape)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    randomize_lora_b(model)
    model.train()
    return model


def test_hf_llama_bf16_parity_with_both_features():
    peft = pytest.importorskip("peft")
    exact_model = build_llama("small", dtype=torch.float64, device=DEV, attn_implementation="sdpa")
    exact_model = peft.get_peft_model(exact_model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    randomize_lora_b(exact_model)
    model = build_llama("small", dtype=torch.float64, device=DEV, attn_implementation="sdpa")
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    model.load_state_dict(exact_model.state_dict())
    model = model.to(torch.bfloat16)
    for m in (exact_model, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = make_batch(2048, 2, 2048, device=DEV)
    batch["labels"][:, :300] = -100
    exact = run_step(exact_model, batch)
    ref = run_step(model, batch)
    loss_handle = apply_chunked_loss(model, num_chunks=5)
    mlp_handle = apply_tiled_mlp(model, num_shards=4)
    got = run_step(model, batch)
    no_worse(got[0], ref[0], exact[0], "loss")
    assert got[1].keys() == ref[1].keys() == exact[1].keys()
    for name in exact[1]:
        no_worse(got[1][name], ref[1][name], exact[1][name], name)
    mlp_handle.remove()
    loss_handle.remove()


def test_hf_peak_memory_drops_with_chunked_loss_and_tiled_mlp():
    """16K tokens, 128256 vocab, intermediate 14336, LoRA, HF checkpointing: the chunked
    loss removes the logits' ~20 GiB; tiling the MLP in 4 shards then removes most of a
    layer's recomputed intermediates (4 x 448 MiB saved, plus their gradients)."""
    model = lora_model(
        layers=2,
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=14336,
        num_attention_heads=8,
        num_key_value_heads=4,
        attn_implementation="sdpa",
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = make_batch(VOCAB, 1, 16384, device=DEV)
    ref, ref_peak = peak(lambda: run_step(model, batch))
    # Small chunks (256 MiB of fp32 logits) so that the MLP, not the loss, sets the next peak.
    loss_handle = apply_chunked_loss(model, num_chunks=32)
    chunked, chunked_peak = peak(lambda: run_step(model, batch))
    mlp_handle = apply_tiled_mlp(model, num_shards=4)
    both, both_peak = peak(lambda: run_step(model, batch))
    mlp_handle.remove()
    loss_handle.remove()
    for got in (chunked, both):
        torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=0)
    assert chunked_peak < ref_peak - 10 * GIB, f"{chunked_peak / GIB:.2f} vs {ref_peak / GIB:.2f} GiB"
    assert both_peak < chunked_peak - 1 * GIB, f"{both_peak / GIB:.2f} vs {chunked_peak / GIB:.2f} GiB"


def test_tiled_mlp_8b_shape_parity_and_peak():
    """One 8B-shaped MLP (4096 -> 14336) with LoRA on 32K tokens: 8 shards vs untiled."""
    model = lora_model(
        layers=1,
        vocab_size=256,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    mlp = model.base_model.model.model.layers[0].mlp
    params = [p for p in mlp.parameters() if p.requires_grad]
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(1, 32768, 4096, device=DEV, generator=g, dtype=torch.bfloat16)
    up = torch.randn(1, 32768, 4096, device=DEV, generator=g, dtype=torch.bfloat16)

    def run(tiled):
        xx = x.clone().requires_grad_()
        for p in params:
            p.grad = None
        out = tiled_forward(mlp.forward, xx, 8, params) if tiled else mlp(xx)
        out.backward(up)
        return xx.grad, [p.grad.clone() for p in params]

    ref, ref_peak = peak(lambda: run(False))
    got, got_peak = peak(lambda: run(True))
    assert rel_err(got[0], ref[0]) < 2e-2
    for a, b in zip(got[1], ref[1]):
        assert rel_err(a, b) < 2e-2
    assert got_peak * 2 < ref_peak, f"tiled {got_peak / GIB:.2f} GiB vs untiled {ref_peak / GIB:.2f} GiB"


def test_composes_with_input_offload_and_layer_streaming():
    """Chunked loss + tiled MLP under offloadkit's checkpointing with block-input offload and
    frozen-layer streaming: bitwise equal to the same features under HF checkpointing, and
    streaming's backward prefetch still starts at the head (no misses)."""
    model = lora_model(layers=4)
    batch = make_batch(2048, 2, 512, device=DEV)
    loss_handle = apply_chunked_loss(model, num_chunks=3)
    mlp_handle = apply_tiled_mlp(model, num_shards=3)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = run_step(model, batch)
    model.gradient_checkpointing_disable()
    ckpt = apply_activation_checkpointing(model, offload_inputs=True)
    streamer = apply_layer_streaming(model)
    for _ in range(2):
        got = run_step(model, batch)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "lora grads")
    assert streamer.stats.misses == 0 and streamer.resident_layers == 0
    assert ckpt.offloader.collect_stats().prefetch_misses == 0
    streamer.remove()
    ckpt.remove()
    mlp_handle.remove()
    loss_handle.remove()


def test_tiled_projections_bf16_no_worse_than_untiled():
    """Norms, attention projections (LoRA) and MLP tiled: bf16 loss and adapter gradients
    no further from an fp64 reference than the untiled bf16 run, plus 1e-3."""
    peft = pytest.importorskip("peft")
    exact_model = build_llama("small", dtype=torch.float64, device=DEV, attn_implementation="sdpa")
    exact_model = peft.get_peft_model(exact_model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    randomize_lora_b(exact_model)
    model = build_llama("small", dtype=torch.float64, device=DEV, attn_implementation="sdpa")
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    model.load_state_dict(exact_model.state_dict())
    model = model.to(torch.bfloat16)
    for m in (exact_model, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = make_batch(2048, 2, 2048, device=DEV)
    exact = run_step(exact_model, batch)
    ref = run_step(model, batch)
    handle = apply_tiled_mlp(model, num_shards=4, projections=True)
    got = run_step(model, batch)
    handle.remove()
    no_worse(got[0], ref[0], exact[0], "loss")
    for name in exact[1]:
        no_worse(got[1][name], ref[1][name], exact[1][name], name)


def test_tiled_projections_saved_bytes_match_the_planner_on_cuda():
    """What one LoRA decoder layer saves with everything tiled is the planner's figure (SDPA's
    output shared with the o projection's input), under half of the untiled layer's."""
    from offloadkit.planning import Workload, resolve_shape
    from offloadkit.planning.memory import layer_saved_bytes

    peft = pytest.importorskip("peft")
    model = build_llama("small", dtype=torch.bfloat16, device=DEV, attn_implementation="sdpa", num_hidden_layers=1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    layer = model.base_model.model.model.layers[0]
    base = model.base_model.model.model
    b, s, h = 2, 1024, model.config.hidden_size
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(projections):
        handle = apply_tiled_mlp(model, num_shards=4, projections=projections)
        x = torch.randn(b, s, h, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        pos = torch.arange(s, device=DEV)[None].expand(b, s)
        cos, sin = base.rotary_emb(x, pos)
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
        handle.remove()
        skip = params | {
            x.untyped_storage().data_ptr(),
            cos.untyped_storage().data_ptr(),
            sin.untyped_storage().data_ptr(),
        }
        return sum(n for p, n in seen.items() if p not in skip)

    w = Workload(resolve_shape("small", layers=1), s, b, lora_rank=8)
    tiled, untiled = saved(True), saved(False)
    predicted = layer_saved_bytes(w, mlp_shards=4, tiled_projections=True)
    assert abs(tiled - predicted) <= 0.03 * predicted, (tiled, predicted)
    assert tiled < 0.5 * untiled, (tiled, untiled)


def test_tiled_projections_compose_with_input_offload_and_streaming():
    """The config route a long-context plan produces (tiled projections, horizon 1, block inputs
    on disk, streaming) equals the same tiling under HF checkpointing, bitwise."""
    from offloadkit.compose import prepare

    model = lora_model(layers=4)
    batch = make_batch(2048, 1, 1024, device=DEV)
    loss_handle = apply_chunked_loss(model, num_chunks=3)
    mlp_handle = apply_tiled_mlp(model, num_shards=3, projections=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = run_step(model, batch)
    model.gradient_checkpointing_disable()
    mlp_handle.remove()
    loss_handle.remove()
    runtime = prepare(
        model,
        {
            "gradient_checkpointing": True,
            "activation_offloading": "disk",
            "layer_offloading": True,
            "activation_loading_horizon": 1,
            "chunked_cross_entropy": True,
            "chunked_cross_entropy_num_chunks": 3,
            "tiled_mlp": True,
            "tiled_mlp_num_shards": 3,
            "tiled_projections": True,
        },
    )
    try:
        for _ in range(2):
            with runtime.context():
                got = run_step(model, batch)
            assert_bitwise_equal(ref[0], got[0], "loss")
            assert_bitwise_equal(ref[1], got[1], "lora grads")
        report = runtime.report()
        assert report["storage"]["disk"]["bytes_written"] > 0
    finally:
        runtime.close()


def test_rebuilt_norm_outputs_bitwise_on_cuda():
    """q, k, v and the MLP save the norms' inputs and rebuild the norms' outputs in backward:
    bf16 gradients bitwise those of each module saving its own input, under checkpointing.
    Attention runs SDPA's math kernel here, whose backward reproduces itself (the fused ones
    accumulate the query gradient in a varying order, a spread one rerun cannot bound)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    peft = pytest.importorskip("peft")
    batch = make_batch(2048, 1, 4096, device=DEV)
    results = {}
    for run, rebuild in ((0, False), (1, False), (2, True)):
        torch.manual_seed(0)
        model = build_llama("small", dtype=torch.bfloat16, device=DEV, attn_implementation="sdpa", num_hidden_layers=3)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
        randomize_lora_b(model)
        handle = apply_tiled_mlp(model, num_shards=3, projections=True)
        if not rebuild:
            handle._norms = set()  # the reference: every tiled module saves its own input
        ckpt = apply_activation_checkpointing(model)
        with sdpa_kernel(SDPBackend.MATH):
            results[run] = run_step(model, batch)
        results[run, "rebuilt"] = handle.rebuilt_inputs
        ckpt.remove()
        handle.remove()
    assert_bitwise_equal(results[0][0], results[2][0], "loss")
    assert assert_equal_as_reruns(results[0][1], results[1][1], results[2][1], "grads") == "bitwise"
    assert results[2, "rebuilt"] > 0 and results[0, "rebuilt"] == 0
