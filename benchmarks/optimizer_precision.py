"""BackwardAdamW's three optimizer precisions on one real run: the loss curve of pure bf16
(``params``), the compact state (``compact``: bf16 moments, stochastic rounding) and fp32
master weights and moments (``fp32_master``), on the same bf16 model, data and schedule.

A Llama-shaped model (random init, byte vocabulary) trains on the shipped text for
``--steps`` steps with a warm-up and a cosine decay to a tenth of the peak learning rate,
where pure bf16 starts losing updates to rounding. Writes ``optimizer-precision.json``
(every loss, step times, host state bytes) and ``optimizer-precision.md`` under ``--out``.

    python benchmarks/optimizer_precision.py --out DIR            # on a GPU, 200 steps
    python benchmarks/optimizer_precision.py --out DIR --device cpu --shape tiny --steps 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import sysconfig
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts  # noqa: E402
from offloadkit.models.zoo import LLAMA_SHAPES, build_llama  # noqa: E402
from offloadkit.optim import BackwardAdamW  # noqa: E402

# About 140M parameters: large enough that late updates are far below a bf16 step.
SHAPES = {
    **LLAMA_SHAPES,
    "140m": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=259,
    ),
}
PRECISIONS = ("params", "compact", "fp32_master")


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def run(precision: str, args) -> dict:
    device = torch.device(args.device)
    model = build_llama(SHAPES[args.shape], vocab_size=259, dtype=torch.bfloat16, device=device, seed=0)
    model.config._attn_implementation = "sdpa"
    opt = BackwardAdamW.for_precision(model.parameters(), precision, lr=args.lr, weight_decay=0.1)
    data = TokenBlocks(byte_tokenizer(), corpus(args), args.seq_len)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    losses, times = [], []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, args.steps, args.lr, args.warmup)
        rows = [data[int(order[(step * args.batch + i) % len(data)])] for i in range(args.batch)]
        batch = {k: torch.stack([r[k] for r in rows]).to(device) for k in ("input_ids", "labels")}
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()  # each parameter updated here
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    params = sum(p.numel() for p in model.parameters())
    return {
        "precision": precision,
        "losses": losses,
        "median_step_s": statistics.median(times[2:] or times),
        "host_state_bytes_per_param": state_bytes / params,
        "params": params,
    }


def corpus(args) -> list[str]:
    """The texts to train on: the shipped text, Python's own standard library sources (several
    MB of real code and prose that any machine with Python has, so that 200 steps do not
    repeat it), or a file :func:`load_texts` reads."""
    if args.corpus == "shipped":
        return load_texts()
    if args.corpus != "stdlib":
        return load_texts(args.corpus)
    root = sysconfig.get_paths()["stdlib"]
    texts, size = [], 0
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "idlelib", "site-packages", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py") and size < args.corpus_bytes:
                with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                    texts.append(f.read())
                size += len(texts[-1])
    return texts


def _smooth(xs: list[float], k: int = 10) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def report(records: list[dict], args) -> str:
    by = {r["precision"]: r for r in records}
    ref = _smooth(by["fp32_master"]["losses"])
    lines = [
        f"# Optimizer precision: loss over {args.steps} steps ({args.shape}, {by['fp32_master']['params'] / 1e6:.0f}M "
        f"parameters, {args.batch}x{args.seq_len} tokens a step, peak lr {args.lr}, cosine to 10%)",
        "",
        f"Device: {args.device_name}; torch {torch.__version__}. Command: `python benchmarks/optimizer_precision.py "
        f"--steps {args.steps} --shape {args.shape} --corpus {args.corpus}`.",
        "",
        f"Corpus: {args.corpus} ({args.corpus_tokens:,} tokens; the run reads "
        f"{args.steps * args.batch * args.seq_len:,}, {args.steps * args.batch / max(1, args.corpus_blocks):.2f} "
        "passes).",
        "",
        "| precision | host state, bytes/param | median step, s | loss, last 20 steps (mean) | "
        "gap to fp32_master, last 20 (smoothed, mean) | largest smoothed gap |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in by.items():
        sm = _smooth(r["losses"])
        gaps = [a - b for a, b in zip(sm, ref)]
        tail = slice(-min(20, len(gaps)), None)
        lines.append(
            f"| {name} | {r['host_state_bytes_per_param']:.1f} | {r['median_step_s']:.3f} | "
            f"{statistics.fmean(r['losses'][tail]):.4f} | {statistics.fmean(gaps[tail]):+.4f} | "
            f"{max(gaps, key=abs):+.4f} |"
        )
    lines += ["", "Loss every 10 steps (10-step mean):", "", "| step | " + " | ".join(by) + " |"]
    lines.append("| --- |" + " --- |" * len(by))
    smoothed = {k: _smooth(r["losses"]) for k, r in by.items()}
    for i in list(range(9, args.steps, 10)) or [args.steps - 1]:
        lines.append(f"| {i + 1} | " + " | ".join(f"{smoothed[k][i]:.4f}" for k in by) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="140m", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--corpus", default="shipped", help="shipped, stdlib (Python's own sources) or a text/jsonl file")
    ap.add_argument("--corpus-bytes", type=int, default=16 << 20, help="with --corpus stdlib: how much of it")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    args.device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    os.makedirs(args.out, exist_ok=True)
    texts = corpus(args)
    args.corpus_tokens = sum(len(t) for t in texts)  # bytes: the byte tokenizer's tokens
    args.corpus_blocks = len(TokenBlocks(byte_tokenizer(), texts, args.seq_len))
    records = []
    for precision in PRECISIONS:
        records.append(run(precision, args))
        r = records[-1]
        print(f"== {precision}: first {r['losses'][0]:.4f} last {r['losses'][-1]:.4f} step {r['median_step_s']:.3f}s")
    with open(os.path.join(args.out, "optimizer-precision.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "records": records}, f, indent=1)
    text = report(records, args)
    with open(os.path.join(args.out, "optimizer-precision.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
