"""The compatibility matrix's cells that run on a CPU: every model family with offloading
(bitwise) and with checkpoint-input offload (bitwise against checkpointing alone), the
precisions a Trainer uses, packed documents (offloading bitwise; the chunked loss per
document against each document run alone), and whole-model torch.compile, which offloading
cannot serve, warned about. The GPU rows are ``benchmarks/compat.py``."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from offloadkit import apply_chunked_loss, get_act_offloading_ctx_manager  # noqa: E402
from offloadkit.checkpointing import apply_activation_checkpointing  # noqa: E402
from offloadkit.testing import assert_bitwise_equal, run_step  # noqa: E402
from offloadkit.testing.families import FAMILIES, build_family, family_batch, packed_batch  # noqa: E402


def _cpu_manager(model):
    # CPU tensors are offloaded too (to the engine's CPU path), so the bookkeeping runs for real.
    return get_act_offloading_ctx_manager(model, warn_if_no_head=False, offload_cpu_tensors=True, min_offload_size=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_offloading_is_bitwise(family):
    model = build_family(family)
    batch = family_batch(family, model, 48, batch=2)
    ref = run_step(model, batch)
    ctx = _cpu_manager(model)
    got = run_step(model, batch, ctx)
    assert ctx.stats.offloaded_tensors > 0
    assert_bitwise_equal(ref[0], got[0], f"{family} loss")
    assert_bitwise_equal(ref[1], got[1], f"{family} grads")
    if family in ("qwen3_moe", "mixtral", "gpt_oss"):
        routers = [n for n in got[1] if ".gate." in n or ".router." in n]
        assert routers and all(got[1][n].abs().sum() > 0 for n in routers), "the aux loss reaches the router"
    ctx.close()


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3", "mixtral", "qwen2_vl"])
def test_family_checkpoint_input_offload_is_bitwise(family):
    model = build_family(family)
    batch = family_batch(family, model, 48, batch=2)
    plain = apply_activation_checkpointing(model)
    ref = run_step(model, batch)
    plain.remove()
    handle = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True, min_offload_size=0)
    got = run_step(model, batch)
    assert handle.offloader.stats.offloaded_tensors > 0
    handle.remove()
    assert_bitwise_equal(ref[0], got[0], f"{family} loss")
    assert_bitwise_equal(ref[1], got[1], f"{family} grads")


@pytest.mark.parametrize("precision", ["fp32", "autocast bf16", "fp16 with a loss scaler"])
def test_precisions_offloading_is_bitwise(precision):
    model = build_family("llama")
    batch = family_batch("llama", model, 48, batch=2)
    dtype = {"fp32": None, "autocast bf16": torch.bfloat16, "fp16 with a loss scaler": torch.float16}[precision]
    scale = 65536.0 if dtype == torch.float16 else 1.0

    def step(ctx=None):
        model.zero_grad(set_to_none=True)
        with (
            ctx if ctx is not None else torch.enable_grad(),
            torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None),
        ):
            loss = model(**batch).loss
        (loss * scale).backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = step()
    ctx = _cpu_manager(model)
    got = step(ctx)
    assert all(torch.isfinite(g).all() for g in got[1].values())
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    ctx.close()


def _per_token_loss(model, batch):
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none", ignore_index=-100
    )


def test_packed_documents_match_each_document_alone():
    """TRL's padding-free batches: positions restart per document. The loss of every document
    equals running it alone, the chunked loss never crosses a boundary, and offloading is
    bitwise."""
    model = build_family("llama").eval()
    lengths = [20, 33, 11]
    packed = packed_batch(model.config.vocab_size, lengths)
    together = _per_token_loss(model, packed)
    start = 0
    for n in lengths:
        alone = {
            "input_ids": packed["input_ids"][:, start : start + n],
            "labels": packed["labels"][:, start : start + n],
            "use_cache": False,
        }
        alone["labels"] = alone["labels"].clone()
        alone["labels"][:, 0] = -100
        # The packed row's last token of a document predicts the next document's first, which
        # is ignored there as in the document alone (its end).
        torch.testing.assert_close(
            together[start : start + n - 1], _per_token_loss(model, alone)[: n - 1], rtol=1e-5, atol=1e-5
        )
        start += n
    model.train()
    ref = run_step(model, packed)
    ctx = _cpu_manager(model)
    got = run_step(model, packed, ctx)
    assert_bitwise_equal(ref[0], got[0], "packed loss")
    assert_bitwise_equal(ref[1], got[1], "packed grads")
    ctx.close()
    handle = apply_chunked_loss(model, chunk_tokens=7)  # chunks that straddle the documents' boundaries
    chunked = run_step(model, packed)
    handle.remove()
    torch.testing.assert_close(chunked[0], ref[0], rtol=1e-5, atol=1e-6)
    for name in ref[1]:
        torch.testing.assert_close(chunked[1][name], ref[1][name], rtol=1e-4, atol=1e-6 * ref[1][name].abs().max())


def test_whole_model_compile_is_warned_about():
    model = build_family("llama")
    model.compile()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = get_act_offloading_ctx_manager(model, warn_if_no_head=False)
    assert any("compiled as a whole" in str(w.message) and "layer.compile()" in str(w.message) for w in caught)
    ctx.close()
    regional = build_family("llama")
    for layer in regional.model.layers:
        layer.compile()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_act_offloading_ctx_manager(regional, warn_if_no_head=False).close()


def test_regionally_compiled_layers_with_checkpoint_input_offload():
    """layer.compile() on every decoder layer: offloadkit's checkpoint runs eagerly around
    each compiled layer (the checkpoint and the offloading hooks are Python side effects), the
    layer's own forward stays compiled, and the result is bitwise the checkpointed run's."""
    model = build_family("llama")
    batch = family_batch("llama", model, 32, batch=2)
    for layer in model.model.layers:
        layer.compile()
    plain = apply_activation_checkpointing(model)
    ref = run_step(model, batch)
    plain.remove()
    handle = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True, min_offload_size=0)
    got = run_step(model, batch)
    assert handle.offloader.stats.offloaded_tensors > 0 and len(handle._compiled) == len(model.model.layers)
    handle.remove()
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    torch._dynamo.reset()
