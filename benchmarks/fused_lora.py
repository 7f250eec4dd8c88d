"""PEFT's LoRA path against ``fused_lora: true``, side by side on one GPU, interleaved.

One process per run (a fresh allocator and peak), alternating the two paths ``--rounds``
times at each length: the 8B LoRA (r=16, every linear layer, adapters in fp32 as PEFT keeps
them) at reduced depth, with the long-context configuration ``offload_plan: auto`` chooses
for that length (``--set key=value`` adds keys). Per run: step time (median of ``--steps``
after ``--warmup``), tokens/s, peaks (allocated, reserved), host RSS, the first step's loss
and gradient norm (the same weights and batch for both paths), and with
``--kernel-breakdown`` one more step's GPU time by kernel group (``kernel_time.py``).

  PYTHONPATH=$PWD python3 benchmarks/fused_lora.py --seq-lens 16384,65536 --layers 2 --out /tmp/fused
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GiB = float(1 << 30)


def _child(args) -> dict:
    import psutil
    import torch

    from offloadkit.bench.provenance import provenance
    from offloadkit.compose import prepare
    from offloadkit.integrations.peft_utils import apply_lora
    from offloadkit.testing import build_llama, make_batch, randomize_lora_b

    torch.manual_seed(0)
    model = build_llama(
        args.shape, dtype=torch.bfloat16, device=args.device, attn_implementation="sdpa", num_hidden_layers=args.layers
    )
    model.config.use_cache = False
    model = apply_lora(model, rank=args.lora_rank)
    randomize_lora_b(model)
    model.train()
    config = {"offload_plan": "auto", "seq_len": args.seq_len, "fused_lora": args.mode == "fused"}
    for item in args.set or []:
        key, _, value = item.partition("=")
        config[key] = json.loads(value) if value[:1] in "0123456789tfn[{" else value
    runtime = prepare(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    batch = make_batch(model.config.vocab_size, 1, args.seq_len, device=args.device, seed=1)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    first: dict = {}

    def step() -> None:
        with runtime.context():
            loss = model(**batch).loss
        loss.backward()
        if not first:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params]))
            first.update(loss=loss.item(), grad_norm=norm.item())
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    out = {
        "mode": args.mode,
        "seq_len": args.seq_len,
        "layers": args.layers,
        "step_s": round(statistics.median(times), 4),
        "steps_s": [round(t, 4) for t in times],
        "tokens_per_s": round(args.seq_len / statistics.median(times)),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GiB, 3) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GiB, 3) if cuda else None,
        "host_rss_gib": round(psutil.Process().memory_info().rss / GiB, 2),
        "config": runtime.config.__dict__.get("fused_lora"),
        "report": runtime.report().get("fused_lora"),
        **first,
    }
    if args.kernel_breakdown:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from kernel_time import profile_step

        out["kernel_breakdown"] = profile_step(step)
    out["provenance"] = provenance(sys.argv)
    runtime.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-lens", default="16384,65536")
    ap.add_argument("--rounds", type=int, default=2, help="PEFT, fused, PEFT, fused, ... at each length")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--set", action="append", help="another config key=value for both paths")
    ap.add_argument("--kernel-breakdown", action="store_true")
    ap.add_argument("--out", default="fused-lora-results")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mode", choices=["peft", "fused"], help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mode:
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return 0
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for seq in (int(s) for s in args.seq_lens.split(",")):
        for _ in range(args.rounds):
            for mode in ("peft", "fused"):
                cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--seq-len", str(seq)]
                cmd += [
                    f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("shape", "lora_rank", "layers", "device")
                ]
                cmd += [f"--warmup={args.warmup}", f"--steps={args.steps}"]
                cmd += [f"--set={s}" for s in args.set or []] + (
                    ["--kernel-breakdown"] if args.kernel_breakdown else []
                )
                proc = subprocess.run(cmd, capture_output=True, text=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                row = json.loads(line[7:]) if line else {"mode": mode, "seq_len": seq, "error": proc.stderr[-1500:]}
                rows.append(row)
                print(
                    json.dumps({k: v for k, v in row.items() if k not in ("kernel_breakdown", "provenance")}),
                    flush=True,
                )
    with open(os.path.join(args.out, "fused_lora.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = ["| seq | path | step s (median over runs) | tokens/s | peak alloc / reserved GiB | loss | grad norm |"]
    lines.append("|---|---|---|---|---|---|---|")
    for seq in sorted({r["seq_len"] for r in rows}):
        for mode in ("peft", "fused"):
            ok = [r for r in rows if r["seq_len"] == seq and r["mode"] == mode and "step_s" in r]
            if not ok:
                lines.append(f"| {seq} | {mode} | failed | | | | |")
                continue
            step = statistics.median(r["step_s"] for r in ok)
            lines.append(
                f"| {seq} | {mode} | {step:.3f} ({', '.join(str(r['step_s']) for r in ok)}) | {round(seq / step)} | "
                f"{max(r['peak_allocated_gib'] for r in ok)} / {max(r['peak_reserved_gib'] for r in ok)} | "
                f"{ok[0]['loss']:.5f} | {ok[0]['grad_norm']:.5f} |"
            )
    with open(os.path.join(args.out, "fused_lora.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
