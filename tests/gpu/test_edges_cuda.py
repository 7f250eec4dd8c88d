"""CUDA tests of the edges where silent errors hid: the chunked loss under fp16 with a loss
scaler, the Trainer's fp16=True with offloadkit, MoE blocks with the tiled MLP in bf16,
`offloadkit train` with fp16 and with QLoRA (4-bit base, layer streaming of the quantized
bytes), and hooks pushed on a worker thread's forward that ends after the region.

Tolerances: fp16/bf16 results must be no further from a high-precision reference than 1.5
times the unchunked/untiled result in the same precision is, plus a small floor.
"""

import importlib.util
import json
import threading

import pytest
import torch
import torch.nn.functional as F

from offloadkit import apply_tiled_mlp, chunked_cross_entropy, get_act_offloading_ctx_manager
from offloadkit.cli.main import main

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
transformers = pytest.importorskip("transformers")
DEV = "cuda"


def _fp16_errors(chunked: bool, hidden_dtype, n=8192, hidden=1024, vocab=32000, scale=65536.0):
    g = torch.Generator(device=DEV).manual_seed(0)
    h64 = torch.randn(n, hidden, generator=g, device=DEV, dtype=torch.float64)
    w64 = torch.randn(vocab, hidden, generator=g, device=DEV, dtype=torch.float64) / hidden**0.5
    labels = torch.randint(0, vocab, (n,), generator=g, device=DEV)
    rh, rw = h64.clone().requires_grad_(), w64.clone().requires_grad_()
    F.cross_entropy((rh @ rw.t())[:-1], labels[1:]).backward()
    h = h64.to(hidden_dtype).requires_grad_()
    w = w64.float().requires_grad_()
    with torch.autocast(DEV, dtype=torch.float16):
        if chunked:
            loss = chunked_cross_entropy(h, w, labels, num_chunks=4)
        else:
            loss = F.cross_entropy(F.linear(h, w).float()[:-1], labels[1:])
    (loss * scale).backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    return [
        float((got.double() / scale - ref.grad).norm() / ref.grad.norm()) for got, ref in ((h.grad, rh), (w.grad, rw))
    ]


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.float16])
def test_chunked_loss_fp16_with_loss_scale_as_accurate_as_unchunked(hidden_dtype):
    plain, chunked = _fp16_errors(False, hidden_dtype), _fp16_errors(True, hidden_dtype)
    for got, want in zip(chunked, plain):
        assert got <= 1.5 * want + 1e-4, (chunked, plain)


def _trainer_losses(tmp_path, callbacks, name):
    from offloadkit.testing import build_llama

    torch.manual_seed(0)
    model = build_llama("small", attn_implementation="sdpa").to(DEV)  # fp32 weights: fp16 is mixed precision
    ids = torch.randint(0, model.config.vocab_size, (8, 512))
    rows = [{"input_ids": r, "labels": r.clone()} for r in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=2,
        max_steps=4,
        learning_rate=1e-3,
        fp16=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        remove_unused_columns=False,
        lr_scheduler_type="constant",
        logging_nan_inf_filter=False,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], [
        h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h
    ]


def test_trainer_fp16_with_chunked_loss_and_offloading_matches_plain_fp16(tmp_path):
    from offloadkit.integrations.trainer import OffloadCallback

    ref, ref_norms = _trainer_losses(tmp_path, [], "ref")
    got, norms = _trainer_losses(
        tmp_path,
        [
            OffloadCallback(
                {"chunked_cross_entropy": True, "gradient_checkpointing": True, "activation_offloading": True}
            )
        ],
        "got",
    )
    assert all(map(lambda x: x == x and abs(x) != float("inf"), got + norms)), (got, norms)
    assert got == pytest.approx(ref, rel=2e-2), (got, ref)
    assert norms == pytest.approx(ref_norms, rel=5e-2), (norms, ref_norms)


def test_moe_tiled_bf16_keeps_router_gradient():
    config = transformers.MixtralConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).to(DEV)
    ids = torch.randint(0, 1024, (2, 512), device=DEV)

    def grads(autocast: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach().float(), {
            n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None
        }

    _, exact = grads(False)  # fp32: the reference both bf16 runs are measured against
    _, plain = grads(True)
    handle = apply_tiled_mlp(model, num_shards=4)
    _, tiled = grads(True)
    handle.remove()
    assert tiled.keys() == plain.keys() == exact.keys()
    gates = [n for n in exact if ".gate." in n]
    assert gates and all(tiled[n].abs().sum() > 0 for n in gates)  # the aux loss reaches the router
    for name in gates + [n for n in exact if "experts" in n]:
        scale = exact[name].norm()
        err_tiled = float((tiled[name] - exact[name]).norm() / scale)
        err_plain = float((plain[name] - exact[name]).norm() / scale)
        assert err_tiled <= 1.5 * err_plain + 1e-3, (name, err_tiled, err_plain)


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_cli_fp16_trains_mixed_precision(tmp_path, lora_rank):
    # LoRA: an fp16 frozen base with fp32 adapters under the loss scaler; full: fp32 weights.
    config = tmp_path / "fp16.yaml"
    config.write_text(
        f"model_shape: small\nseq_len: 512\nbatch_size: 4\nmax_steps: 6\nlogging_steps: 1\n"
        f"dtype: float16\noutput_dir: {tmp_path / 'out'}\ncompare: false\nlora_rank: {lora_rank}\n"
        f"learning_rate: 1e-3\nlayer_offloading: {str(bool(lora_rank)).lower()}\n"
        "chunked_cross_entropy: true\n"
    )
    assert main(["train", str(config)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    losses = [loss for _, loss in report["losses"]]
    assert all(loss == loss and abs(loss) != float("inf") for loss in losses), losses
    assert lora_rank or losses[-1] < losses[0], losses
    assert report["dtype"].startswith("float16 mixed precision")


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_cli_qlora_streams_the_quantized_base(tmp_path):
    config = tmp_path / "qlora.yaml"
    config.write_text(
        f"model_shape: llama-3.2-1b\nseq_len: 1024\nbatch_size: 1\nmax_steps: 4\nlogging_steps: 1\n"
        f"lora_rank: 8\nload_in_4bit: true\ngradient_checkpointing: true\nactivation_offloading: true\n"
        f"layer_offloading: true\noutput_dir: {tmp_path / 'out'}\ncompare: false\n"
    )
    assert main(["train", str(config)]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "4-bit" in report["model"]
    streamed = report["offloaded"]["frozen_weights_streamed_bytes"]
    # The 1B's decoder layers in NF4 are about a quarter of their bf16 bytes (2.4 GB).
    assert 0 < streamed < 0.4 * 2.4e9, streamed
    assert all(loss == loss for _, loss in report["losses"])


def test_worker_forward_ending_after_the_region_pops_its_hooks():
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(0)
    inside, go = threading.Event(), threading.Event()

    class Gate(torch.nn.Module):
        def forward(self, x):
            inside.set()
            assert go.wait(30)
            return x

    net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), Gate(), torch.nn.Tanh(), torch.nn.Linear(1024, 1024)).to(DEV)
    x = torch.randn(4096, 1024, device=DEV, requires_grad=True)
    go.set()
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    inside.clear()
    go.clear()
    ctx = get_act_offloading_ctx_manager(net, warn_if_no_head=False)
    with ThreadPoolExecutor(1) as pool:
        with ctx:
            future = pool.submit(lambda: net(x).sum())
            assert inside.wait(30)
        go.set()
        future.result().backward()
        torch.cuda.synchronize()
        assert all(torch.equal(a, p.grad) for a, p in zip(ref, net.parameters()))
        saved = ctx.stats.saved_tensors
        pool.submit(lambda: net(x).sum()).result()
        assert ctx.stats.saved_tensors == saved
    ctx.close()
