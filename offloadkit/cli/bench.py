"""``offloadkit bench``: the benchmark harness's modes side by side, as a table, JSON and a plot."""

from __future__ import annotations

import os

from offloadkit.bench import BenchConfig, format_table, run_benchmark, save_report
from offloadkit.bench.modes import MODES

__all__ = ["run_bench", "plot_bench"]


def plot_bench(report: dict, path: str) -> str | None:
    """Bar charts of median step time and peak allocated memory per mode (None without matplotlib)."""
    rows = [r for r in report["results"] if r["status"] == "ok"]
    if not rows:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [r["mode"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 2))
    a.barh(names, [r["step_s"] for r in rows], color="tab:blue")
    a.set_xlabel("median step time (s)")
    peaks = [r["peak_allocated_gib"] or 0.0 for r in rows]
    b.barh(names, peaks, color="tab:orange")
    b.set_xlabel("peak allocated GPU memory (GiB)")
    b.set_yticks([])
    fig.suptitle(f"{report['config']['shape']}, {report['config']['seq_len']} tokens, {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_bench(args, log=print) -> dict:
    cfg = BenchConfig(shape=args.shape, seq_len=args.seq_len, lora_rank=args.lora_rank or None, steps=args.steps,
                      warmup=args.warmup, prefetch=args.prefetch, host_budget_gib=args.host_budget_gib,
                      device=args.device, disk_dir=args.disk_dir)
    if args.modes:
        cfg.modes = tuple(m for m in args.modes.split(";") if m)
    unknown = [m for m in cfg.modes if m.split("@")[0] not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {', '.join(sorted(MODES))}")
    report = run_benchmark(cfg, log=log)
    os.makedirs(args.out, exist_ok=True)
    name = args.name or f"{cfg.shape}-{cfg.seq_len}"
    save_report(report, os.path.join(args.out, name + ".json"))
    table = format_table(report)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(table + "\n")
    png = plot_bench(report, os.path.join(args.out, name + ".png"))
    log(table)
    log(f"written: {os.path.join(args.out, name)}.json/.md" + (f", {png}" if png else ""))
    return report
