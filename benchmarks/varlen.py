"""Variable-length batches: pinned host memory over time and step time against fixed length.

Llama-3.2-1B shape, full fine-tune (forward + backward; no optimizer, so the figures are
the engine's), bf16, SDPA attention, one sequence per step. Lengths vary uniformly between
``--min-len`` and ``--max-len`` (seeded); the same lengths run without offloading and with
``get_act_offloading_ctx_manager``. A fixed-length run at ``--max-len`` gives the
reference step time. Every step records its time (synchronised), the host memory held by
the offloading pool, its chunk count and the peak GPU memory.

    python benchmarks/varlen.py --steps 50 --out bench-results/varlen
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import psutil
import torch

from offloadkit import get_act_offloading_ctx_manager
from offloadkit.models.zoo import build_llama, make_batch


def step(model, batch, ctx=None):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if ctx is None:
        loss = model(**batch).loss
    else:
        with ctx:
            loss = model(**batch).loss
    loss.backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, loss.item()


def run(model, lengths, ctx=None, vocab=128256):
    rows = []
    for i, n in enumerate(lengths):
        batch = make_batch(vocab, 1, n, device="cuda", seed=i)
        torch.cuda.reset_peak_memory_stats()
        seconds, loss = step(model, batch, ctx)
        row = dict(
            step=i,
            tokens=n,
            seconds=seconds,
            loss=loss,
            peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
            peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
            rss_gib=psutil.Process().memory_info().rss / 2**30,
        )
        if ctx is not None:
            row.update(
                host_held_gib=ctx.host_bytes() / 2**30,
                chunks=ctx.pool.chunks,
                chunk_allocations=ctx.pool.allocations,
                step_offloaded_gib=ctx.stats.offloaded_bytes / 2**30,
            )
            ctx.reset_stats()
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--fixed-steps", type=int, default=8)
    ap.add_argument("--out", default="bench-results/varlen")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(0)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.steps)]
    model = build_llama("llama-3.2-1b", dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa")
    model.train()
    step(model, make_batch(128256, 1, 1024, device="cuda"))  # warm-up: kernels, allocator

    plain = run(model, lengths)
    ctx = get_act_offloading_ctx_manager(model)
    offload = run(model, lengths, ctx)
    fixed_plain = run(model, [args.max_len] * args.fixed_steps)
    fixed_offload = run(model, [args.max_len] * args.fixed_steps, ctx)

    longest = lengths.index(max(lengths))
    need = max(r["step_offloaded_gib"] for r in offload)
    summary = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        steps=args.steps,
        lengths=f"{args.min_len}-{args.max_len}",
        host_held_final_gib=offload[-1]["host_held_gib"],
        largest_step_offloaded_gib=need,
        host_over_need=offload[-1]["host_held_gib"] / need,
        chunk_allocations_after_longest_step=offload[-1]["chunk_allocations"] - offload[longest]["chunk_allocations"],
        host_held_growth_after_longest_gib=offload[-1]["host_held_gib"] - offload[longest]["host_held_gib"],
        varlen_tokens_per_s_plain=sum(lengths) / sum(r["seconds"] for r in plain[2:]) * (len(plain) / (len(plain) - 2)),
        varlen_tokens_per_s_offload=sum(lengths)
        / sum(r["seconds"] for r in offload[2:])
        * (len(offload) / (len(offload) - 2)),
        varlen_time_ratio=sum(r["seconds"] for r in offload[2:]) / sum(r["seconds"] for r in plain[2:]),
        fixed_median_s_plain=statistics.median(r["seconds"] for r in fixed_plain[2:]),
        fixed_median_s_offload=statistics.median(r["seconds"] for r in fixed_offload[2:]),
        peak_allocated_gib_plain=max(r["peak_allocated_gib"] for r in plain),
        peak_allocated_gib_offload=max(r["peak_allocated_gib"] for r in offload),
        losses_equal=all(a["loss"] == b["loss"] for a, b in zip(plain, offload)),
    )
    summary["fixed_time_ratio"] = summary["fixed_median_s_offload"] / summary["fixed_median_s_plain"]
    with open(os.path.join(args.out, "varlen.json"), "w") as f:
        json.dump(
            dict(summary=summary, plain=plain, offload=offload, fixed_plain=fixed_plain, fixed_offload=fixed_offload),
            f,
            indent=1,
        )
    lines = [
        "| step | tokens | plain s | offload s | host held GiB | chunks | step offloaded GiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p, o in zip(plain, offload):
        lines.append(
            f"| {o['step']} | {o['tokens']} | {p['seconds']:.3f} | {o['seconds']:.3f} | "
            f"{o['host_held_gib']:.2f} | {o['chunks']} | {o['step_offloaded_gib']:.2f} |"
        )
    text = "\n".join(f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in summary.items())
    with open(os.path.join(args.out, "varlen.md"), "w") as f:
        f.write("# Variable-length batches\n\n" + text + "\n\n" + "\n".join(lines) + "\n")
    print(text)


if __name__ == "__main__":
    main()
