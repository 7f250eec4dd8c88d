"""The compatibility matrix's cells as CUDA tests: every model family, the precisions a
Trainer uses, packed documents and a QLoRA base, each with offloading and with
checkpoint-input offload, bitwise against the same step without offloadkit. Attention runs
PyTorch's math kernel: the fused SDPA backward is not deterministic, so only a deterministic
kernel lets equality be asked for. Memory and time rows are ``benchmarks/compat.py``."""

import importlib.util

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from offloadkit import get_act_offloading_ctx_manager
from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.testing import assert_bitwise_equal, run_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")
DEV = "cuda"


def _both_modes(model, batch, step=run_step):
    with sdpa_kernel(SDPBackend.MATH):
        ref = step(model, batch)
        ctx = get_act_offloading_ctx_manager(model, warn_if_no_head=False, min_offload_size=0)
        got = step(model, batch, ctx)
        assert ctx.stats.offloaded_tensors > 0
        ctx.close()
        assert_bitwise_equal(ref[0], got[0], "offload all: loss")
        assert_bitwise_equal(ref[1], got[1], "offload all: grads")
        plain = apply_activation_checkpointing(model)
        ckpt = step(model, batch)
        plain.remove()
        handle = apply_activation_checkpointing(model, offload_inputs=True)
        got = step(model, batch)
        assert handle.offloader.stats.offloaded_tensors > 0
        handle.remove()
        assert_bitwise_equal(ckpt[0], got[0], "checkpoint-input offload: loss")
        assert_bitwise_equal(ckpt[1], got[1], "checkpoint-input offload: grads")


def _families():
    from offloadkit.testing.families import FAMILIES

    return FAMILIES


@pytest.mark.parametrize("family", _families())
def test_family_bf16(family):
    from offloadkit.testing.families import build_family, family_batch

    model = build_family(family, device=DEV, dtype=torch.bfloat16)
    _both_modes(model, family_batch(family, model, 256, batch=2, device=DEV))


@pytest.mark.parametrize("precision", ["fp32", "autocast bf16", "fp16 autocast with GradScaler"])
def test_precisions(precision):
    from offloadkit.testing.families import build_family, family_batch

    model = build_family("llama", device=DEV, dtype=torch.float32)
    batch = family_batch("llama", model, 256, batch=2, device=DEV)
    dtype = {"fp32": None, "autocast bf16": torch.bfloat16, "fp16 autocast with GradScaler": torch.float16}[precision]
    scaler = torch.amp.GradScaler(DEV, init_scale=65536.0) if dtype == torch.float16 else None

    def step(model, batch, ctx=None):
        model.zero_grad(set_to_none=True)
        with (
            ctx if ctx is not None else torch.enable_grad(),
            torch.autocast(DEV, dtype=dtype or torch.bfloat16, enabled=dtype is not None),
        ):
            loss = model(**batch).loss
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    _both_modes(model, batch, step)


def test_packed_documents():
    from offloadkit.testing.families import build_family, packed_batch

    model = build_family("llama", device=DEV, dtype=torch.bfloat16)
    _both_modes(model, packed_batch(model.config.vocab_size, [64, 128, 64], DEV))


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_qlora_base(tmp_path):
    import peft
    import transformers

    from offloadkit.testing import build_llama
    from offloadkit.testing.families import family_batch

    build_llama("small", dtype=torch.bfloat16).save_pretrained(tmp_path)
    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=quant, dtype=torch.bfloat16, device_map={"": DEV}, attn_implementation="sdpa"
    )
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear")).train()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    _both_modes(model, family_batch("llama", model, 256, batch=2, device=DEV))


def test_layers_compiled_one_by_one_offload_everything_bitwise():
    """Regional compile (``layer.compile()``) with offloading every saved tensor. Inductor's
    deterministic mode fixes its reduction configs, so the compiled plain step repeats bit for
    bit; against that, offloading is held to bitwise equality too."""
    import torch._inductor.config as inductor_config

    from offloadkit.testing.families import build_family, family_batch

    torch._dynamo.reset()
    model = build_family("llama", device=DEV, dtype=torch.bfloat16)
    for layer in model.model.layers:
        layer.compile()
    batch = family_batch("llama", model, 256, batch=2, device=DEV)
    try:
        with inductor_config.patch(deterministic=True), sdpa_kernel(SDPBackend.MATH):
            ref = run_step(model, batch)
            again = run_step(model, batch)
            assert_bitwise_equal(ref[1], again[1], "the compiled plain step repeats itself")
            ctx = get_act_offloading_ctx_manager(model, warn_if_no_head=False, min_offload_size=0)
            got = run_step(model, batch, ctx)
            assert ctx.stats.offloaded_tensors > 0
            ctx.close()
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "grads")
    finally:
        torch._dynamo.reset()
