"""The compatibility matrix on one GPU: model families, precisions, QLoRA, torch.compile and
packed batches, each cell a training step with and without offloadkit on the same model and
batch.

For each cell: parity (bitwise for offloading; the chunked loss is held to a tolerance), the
peak GPU memory allocated in the step without and with offloadkit, and the step-time ratio
(median of the timed steps after warm-up, synchronized). A cell that cannot work prints the
message offloadkit gives.

    python benchmarks/compat.py --out results/ [--cells families,precisions,...] [--seq-len 4096]

Writes ``compat.json`` (one record per cell) and ``compat.md`` (the table) under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offloadkit import get_act_offloading_ctx_manager  # noqa: E402
from offloadkit.checkpointing import apply_activation_checkpointing  # noqa: E402
from offloadkit.testing.families import FAMILIES, build_family, family_batch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SIZE = "bench" if DEV == "cuda" else "tiny"  # a CPU run is a dry run of the script
GIB = 2**30


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def _step(model, batch, ctx_factory, scaler=None, autocast=None):
    model.zero_grad(set_to_none=True)
    with ctx_factory(), torch.autocast(DEV, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = model(**batch).loss
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return loss.detach().float()


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def measure(model, batch, ctx_factory=contextlib.nullcontext, steps=3, warmup=1, **kw):
    """(loss, grads, peak allocated bytes of a step, median step seconds); on a CPU (a dry
    run of the script) the peak is 0."""
    for _ in range(warmup):
        _step(model, batch, ctx_factory, **kw)
    _sync()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if DEV == "cuda" else 0
    times = []
    loss = None
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        loss = _step(model, batch, ctx_factory, **kw)
        _sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base if DEV == "cuda" else 0
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return loss, grads, peak, statistics.median(times)


def _clean():
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def _parity(run_ref, run_got, ref, got) -> str:
    """ "bitwise", or why not. SDPA's fused backward kernels are not deterministic, so when
    the plain step does not repeat itself bit for bit, both are run once more with PyTorch's
    math attention (deterministic), which is what the parity is then judged on."""
    if _equal(ref[0], got[0]) and _equal(ref[1], got[1]):
        return "bitwise"
    again = run_ref()
    if _equal(ref[0], again[0]) and _equal(ref[1], again[1]):
        return "DIFFERS"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        ref, got, again = run_ref(), run_got(), run_ref()
    if _equal(ref[0], got[0]) and _equal(ref[1], got[1]):
        return "bitwise (math attention; fused SDPA backward is nondeterministic)"
    worst = _worst(ref[1], got[1])
    if _equal(ref[1], again[1]):
        return f"DIFFERS (math attention; largest relative grad difference {worst:.1e}; the plain run repeats itself)"
    return (
        f"DIFFERS (math attention; largest relative grad difference {worst:.1e}; between two plain runs "
        f"{_worst(ref[1], again[1]):.1e}: the plain run does not repeat itself)"
    )


def _worst(ref: dict, got: dict) -> float:
    """The largest relative norm difference over the gradients."""
    return max(float((got[n].float() - ref[n].float()).norm() / (ref[n].float().norm() + 1e-30)) for n in ref)


def _record(cell, parity, ref, got, note=""):
    return {
        "cell": cell,
        "status": "works",
        "parity": parity,
        "peak_without_gib": ref[2] / GIB,
        "peak_with_gib": got[2] / GIB,
        "time_ratio": got[3] / ref[3],
        "note": note,
    }


def offload_cells(name, model, batch, **kw):
    """Offload-everything and checkpoint-input offload against their plain references; each
    mode is its own cell, recorded as failed with the message when it raises."""
    out = []
    extra = {} if DEV == "cuda" else {"offload_cpu_tensors": True}
    try:
        ref = measure(model, batch, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx = get_act_offloading_ctx_manager(model, warn_if_no_head=False, **extra)
        note = "; ".join(str(w.message)[:160] for w in caught if "offloadkit" in str(w.message))
        got = measure(model, batch, lambda: ctx, **kw)
        parity = _parity(
            lambda: measure(model, batch, steps=1, warmup=0, **kw),
            lambda: measure(model, batch, lambda: ctx, steps=1, warmup=0, **kw),
            ref,
            got,
        )
        ctx.close()
        out.append(_record(f"{name}: offload all", parity, ref, got, note))
    except Exception as exc:  # noqa: BLE001 - a failing cell is a result
        out.append({"cell": f"{name}: offload all", "status": "failed", "note": _why(exc)})
    _clean()
    try:
        plain = apply_activation_checkpointing(model)
        ckpt = measure(model, batch, **kw)
        plain.remove()
        handle = apply_activation_checkpointing(model, offload_inputs=True, **extra)
        got = measure(model, batch, **kw)
        handle.remove()

        def run_with(offload):
            h = apply_activation_checkpointing(model, offload_inputs=offload, **(extra if offload else {}))
            try:
                return measure(model, batch, steps=1, warmup=0, **kw)
            finally:
                h.remove()

        parity = _parity(lambda: run_with(False), lambda: run_with(True), ckpt, got)
        out.append(_record(f"{name}: checkpoint-input offload (vs checkpointing)", parity, ckpt, got))
    except Exception as exc:  # noqa: BLE001
        out.append({"cell": f"{name}: checkpoint-input offload", "status": "failed", "note": _why(exc)})
    _clean()
    return out


def cells_families(args):
    rows = []
    for family in FAMILIES:
        try:
            model = build_family(family, size=SIZE, device=DEV, dtype=torch.bfloat16)
            batch = family_batch(family, model, args.seq_len, device=DEV)
            rows += offload_cells(family, model, batch)
        except Exception as exc:  # noqa: BLE001 - a failing cell is a result
            rows.append({"cell": f"{family}", "status": "failed", "note": _why(exc)})
        finally:
            model = None
            _clean()
    return rows


def cells_precisions(args):
    rows = []
    cases = [
        ("bf16 weights", torch.bfloat16, None, False),
        ("fp32", torch.float32, None, False),
        ("autocast bf16 over fp32", torch.float32, torch.bfloat16, False),
        ("fp16 autocast + GradScaler over fp32", torch.float32, torch.float16, True),
    ]
    for label, dtype, autocast, scale in cases:
        model = build_family("llama", size=SIZE, device=DEV, dtype=dtype)
        batch = family_batch("llama", model, args.seq_len // 2, device=DEV)
        scaler = torch.amp.GradScaler(DEV, init_scale=65536.0) if scale else None
        autocast = autocast if DEV == "cuda" or autocast != torch.float16 else torch.float16
        try:
            rows += offload_cells(f"llama, {label}", model, batch, autocast=autocast, scaler=scaler)
        except Exception as exc:  # noqa: BLE001
            rows.append({"cell": f"llama, {label}", "status": "failed", "note": _why(exc)})
        model = None
        _clean()
    return rows


def cells_qlora(args):
    import tempfile

    import peft
    import transformers

    from offloadkit.layers import apply_layer_streaming
    from offloadkit.models.zoo import build_llama

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        build_llama("llama-3.2-1b" if SIZE == "bench" else "small", dtype=torch.bfloat16).save_pretrained(folder)
        quant = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=quant, dtype=torch.bfloat16, device_map={"": DEV}, attn_implementation="sdpa"
        )
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules="all-linear")).train()
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    batch = family_batch("llama", model, args.seq_len, device=DEV)
    rows += offload_cells("QLoRA (nf4, double quant) 1B", model, batch)
    ref = measure(model, batch)
    streamer = apply_layer_streaming(model)
    got = measure(model, batch)
    host = streamer.streamed_bytes
    streamer.remove()

    def streamed():
        again = apply_layer_streaming(model)
        try:
            return measure(model, batch, steps=1, warmup=0)
        finally:
            again.remove()

    parity = _parity(lambda: measure(model, batch, steps=1, warmup=0), streamed, ref, got)
    rows.append(
        _record(
            "QLoRA 1B: layer streaming of the 4-bit base",
            parity,
            ref,
            got,
            note=f"{host / GIB:.2f} GiB of quantized layers in host memory (bf16 would be about "
            f"{16 * 60.8e6 * 2 / GIB:.2f})",
        )
    )
    return rows


def cells_compile(args):
    """Whole-model and regional compile; regional again with inductor's deterministic mode and
    the math attention kernel, where the compiled plain step repeats itself, so parity can be
    judged bit for bit."""
    import torch._inductor.config as inductor_config

    rows = []
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for how in ("whole model", "per decoder layer", "per decoder layer, deterministic (inductor mode, math attention)"):
        model = build_family("llama", size=SIZE, device=DEV, dtype=torch.bfloat16)
        batch = family_batch("llama", model, args.seq_len, device=DEV)
        if how == "whole model":
            model.compile()
        else:
            for layer in model.model.layers:
                layer.compile()
        mode = contextlib.ExitStack()
        if "deterministic" in how:
            # Traced under these from the first step: a compiled graph keeps the attention
            # kernel it was traced with, whatever backend is asked for later.
            mode.enter_context(inductor_config.patch(deterministic=True))
            mode.enter_context(sdpa_kernel(SDPBackend.MATH))
        try:
            with mode:
                rows += offload_cells(f"torch.compile {how}", model, batch)
        except Exception as exc:  # noqa: BLE001
            rows.append({"cell": f"torch.compile {how}", "status": "failed", "note": _why(exc)})
        model = None
        torch._dynamo.reset()
        _clean()
    return rows


def cells_packing(args):
    from offloadkit.testing.families import packed_batch

    model = build_family("llama", size=SIZE, device=DEV, dtype=torch.bfloat16)
    batch = packed_batch(model.config.vocab_size, [args.seq_len // 4, args.seq_len // 2, args.seq_len // 4], DEV)
    rows = offload_cells("llama, packed documents (position_ids restart)", model, batch)
    model = None
    _clean()
    return rows


def _why(exc) -> str:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return " ".join(last.split())[:300]


CELLS = {
    "families": cells_families,
    "precisions": cells_precisions,
    "qlora": cells_qlora,
    "compile": cells_compile,
    "packing": cells_packing,
}


def table(rows) -> str:
    lines = [
        "| cell | result | parity | peak GiB without -> with | step time ratio | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "works":
            lines.append(f"| {r['cell']} | {r['status']} | | | | {r['note']} |")
            continue
        lines.append(
            f"| {r['cell']} | works | {r['parity']} | {r['peak_without_gib']:.2f} -> {r['peak_with_gib']:.2f} | "
            f"{r['time_ratio']:.3f} | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    header = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)", "torch": torch.__version__}
    import transformers

    header["transformers"] = transformers.__version__
    for name in args.cells.split(","):
        start = time.perf_counter()
        try:
            got = CELLS[name](args)
        except Exception as exc:  # noqa: BLE001
            got = [{"cell": name, "status": "failed", "note": _why(exc)}]
        rows += got
        for r in got:
            print(json.dumps(r), flush=True)
        print(f"== {name} in {time.perf_counter() - start:.0f} s", flush=True)
        with open(os.path.join(args.out, "compat.json"), "w") as f:
            json.dump({**header, "seq_len": args.seq_len, "cells": rows}, f, indent=1)
    text = (
        f"{header['device']}, torch {header['torch']}, transformers {header['transformers']}, "
        f"{args.seq_len} tokens\n\n" + table(rows)
    )
    with open(os.path.join(args.out, "compat.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
