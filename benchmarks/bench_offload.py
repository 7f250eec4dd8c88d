"""Activation offloading benchmark: python benchmarks/bench_offload.py --shape llama-3.2-1b

Writes <out>/<name>.json and <out>/<name>.md; prints the table.
"""

import argparse
import os

from offloadkit.bench import BenchConfig, format_table, run_benchmark, save_report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--lora-rank", type=int, default=None)
    p.add_argument(
        "--modes",
        default=None,
        help="semicolon-separated; a mode may carry overrides: 'ckpt+offload@prefetch=4;offload@prefetch_bytes=1g'",
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=None)
    p.add_argument("--host-budget-gib", type=float, default=None)
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--device", default="cuda")
    p.add_argument("--disk-dir", default=None, help="parent directory for disk-tier spill files")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--name", default=None)
    a = p.parse_args()
    cfg = BenchConfig(
        shape=a.shape,
        seq_len=a.seq_len,
        lora_rank=a.lora_rank,
        steps=a.steps,
        warmup=a.warmup,
        prefetch=a.prefetch,
        host_budget_gib=a.host_budget_gib,
        attn_implementation=a.attn,
        device=a.device,
        disk_dir=a.disk_dir,
    )
    if a.modes:
        cfg.modes = tuple(m for m in a.modes.split(";") if m)
    report = run_benchmark(cfg)
    name = a.name or f"{a.shape}-{a.seq_len}{'-lora' if a.lora_rank else ''}"
    os.makedirs(a.out, exist_ok=True)
    save_report(report, os.path.join(a.out, name + ".json"))
    table = format_table(report)
    with open(os.path.join(a.out, name + ".md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
