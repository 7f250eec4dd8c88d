"""``offloadkit bench``: the benchmark harness's modes side by side, as a table, JSON and a plot.

On a GPU the default is the 1B shape at 16K tokens; without one, the small shape at 1K
tokens with activations offloaded to disk, the tier that saves memory on a CPU."""

from __future__ import annotations

import os
import tempfile

import psutil
import torch

from offloadkit.bench import BenchConfig, format_table, run_benchmark, save_report
from offloadkit.bench.modes import CPU_MODES, MODES, estimated_activation_bytes
from offloadkit.config import ConfigError, check_writable_dir
from offloadkit.models.zoo import LLAMA_SHAPES

__all__ = ["run_bench", "plot_bench", "list_modes", "MODE_SUMMARIES"]

_CPU_FLOPS_LIMIT = 2e13  # about ten minutes of a few CPU cores, for every step of every mode

# One line for each mode of offloadkit/bench/modes.py (a test holds the two to the same names).
# "HF checkpointing" is the model's gradient_checkpointing_enable (non-reentrant).
MODE_SUMMARIES: dict[str, str] = {
    "none": "no memory saving: autograd keeps every activation on the device (the baseline)",
    "ckpt": "HF checkpointing: layer inputs kept, the rest recomputed in backward",
    "ckpt+offload": "HF checkpointing, with what it saves offloaded by offloadkit (to RAM, or disk with --storage)",
    "offload": "no checkpointing: offloadkit offloads every tensor autograd saves",
    "ckpt+save_on_cpu": "HF checkpointing with torch.autograd.graph.save_on_cpu (pinned); needs a GPU",
    "save_on_cpu": "torch.autograd.graph.save_on_cpu for every saved tensor, no checkpointing; needs a GPU",
    "ok_ckpt": "offloadkit's own checkpointing of each decoder layer, nothing offloaded",
    "ckpt+input_offload": "offloadkit's checkpointing with each layer's input offloaded (RAM, or disk with --storage)",
    "ckpt+layer_stream": "HF checkpointing, frozen weights streamed from pinned RAM a layer at a time; needs a GPU",
    "ckpt+input_offload+layer_stream": "offloadkit's checkpointing, layer inputs offloaded and frozen weights "
    "streamed; needs a GPU",
    "everything": "benchmarks/capacity.py only: the planner's checkpointing, input placement (RAM, disk, "
    "replayed), layer streaming, chunked loss and tiling",
    "in_gpu": "benchmarks/capacity.py only: everything's checkpointing, chunked loss and tiling, nothing moved",
    "auto": "benchmarks/capacity.py only: whatever offload_plan: auto chooses",
}


def list_modes() -> str:
    """Every mode ``--modes`` takes, one line each, and the defaults (``--list-modes``)."""
    width = max(len(name) for name in MODES)
    lines = [
        "modes for --modes (';' between them; '@key=value,...' after one overrides a setting, "
        "e.g. 'ckpt+offload@prefetch=4'):"
    ]
    lines += [f"  {name:<{width}}  {MODE_SUMMARIES.get(name, '(no description)')}" for name in MODES]
    lines.append(f"default on a GPU: {';'.join(BenchConfig.modes)}")
    lines.append(f"default on a CPU: {';'.join(CPU_MODES)} (offloadkit modes to disk)")
    return "\n".join(lines)


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
    gpu = any(r["peak_allocated_gib"] is not None for r in rows)
    peaks = [(r["peak_allocated_gib"] if gpu else r["peak_host_rss_gib"]) or 0.0 for r in rows]
    b.barh(names, peaks, color="tab:orange")
    b.set_xlabel("peak allocated GPU memory (GiB)" if gpu else "peak process RSS (GiB)")
    b.set_yticks([])
    fig.suptitle(f"{report['config']['shape']}, {report['config']['seq_len']} tokens, {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _parameters(shape: dict) -> int:
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    embeddings = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings") else 2)
    return layers * (2 * h * h + 2 * h * kv + 3 * h * i) + embeddings


def _cpu_check(cfg: BenchConfig) -> None:
    """Refuse, in one line, a CPU run that would take hours or more RAM than there is."""
    shape = LLAMA_SHAPES[cfg.shape]
    flops = 6 * _parameters(shape) * cfg.batch * cfg.seq_len
    steps = len(cfg.modes) * (cfg.warmup + cfg.steps)
    small = "offloadkit bench --shape small --seq-len 1024"
    if flops * steps > _CPU_FLOPS_LIMIT:
        raise ConfigError(
            f"--shape {cfg.shape} --seq-len {cfg.seq_len} on the CPU: {steps} steps of about "
            f"{flops / 1e12:.1f} TFLOP each would take hours; run it on a CUDA GPU, or try '{small}'"
        )
    need = estimated_activation_bytes(cfg) * (2 if cfg.dtype == "float32" else 1)
    have = psutil.virtual_memory().available
    if need > 0.6 * have:
        raise ConfigError(
            f"--shape {cfg.shape} --seq-len {cfg.seq_len} on the CPU needs about {need / 2**30:.0f} "
            f"GiB of activations and {have / 2**30:.0f} GiB of RAM is available; try '{small}'"
        )


def _check_numbers(args) -> None:
    """One line for a number that cannot work, before anything is built."""
    for flag, value, low, what in (
        ("--seq-len", args.seq_len, 2, "tokens; omit it for the default"),
        ("--steps", args.steps, 1, "timed steps"),
        ("--warmup", args.warmup, 0, "steps"),
        ("--lora-rank", args.lora_rank, 0, "(0: full fine-tune)"),
        ("--prefetch", args.prefetch, 0, "blocks ahead"),
    ):
        if value is not None and value < low:
            raise ConfigError(f"{flag}={value} must be an integer >= {low} {what}")
    if args.host_budget_gib is not None and not args.host_budget_gib > 0:
        raise ConfigError(f"--host-budget-gib={args.host_budget_gib} must be a positive number of GiB")


def _bench_config(args) -> BenchConfig:
    _check_numbers(args)
    cuda = torch.cuda.is_available()
    device = args.device or ("cuda" if cuda else "cpu")
    if device == "cuda" and not cuda:
        raise ConfigError(
            "--device cuda: no CUDA GPU is available here; omit --device to run on the CPU "
            "(activations offloaded to disk)"
        )
    storage = args.storage or ("disk" if device == "cpu" or args.disk_dir else "ram")
    if args.disk_dir and storage == "ram":
        raise ConfigError(f"--disk-dir {args.disk_dir!r} only applies with --storage disk or tiered; drop one")
    if storage == "ram" and device == "cpu":
        raise ConfigError(
            "--storage ram on a CPU moves activations from RAM to RAM and saves nothing; use --storage disk"
        )
    if storage == "tiered" and args.host_budget_gib is None:
        raise ConfigError("--storage tiered needs --host-budget-gib (the RAM share before spilling to disk)")
    if storage != "ram":
        check_writable_dir(args.disk_dir or tempfile.gettempdir(), "--disk-dir", "give a writable directory")
    cfg = BenchConfig(
        shape=args.shape or ("llama-3.2-1b" if device == "cuda" else "small"),
        seq_len=args.seq_len if args.seq_len is not None else (16384 if device == "cuda" else 1024),
        lora_rank=args.lora_rank or None,
        steps=args.steps,
        warmup=args.warmup,
        prefetch=args.prefetch,
        host_budget_gib=args.host_budget_gib,
        device=device,
        disk_dir=args.disk_dir,
        storage=storage,
    )
    if device == "cpu":
        cfg.dtype = "float32"  # bf16 matmuls are slow on most CPUs
        cfg.modes = CPU_MODES
    if args.modes:
        cfg.modes = tuple(m for m in args.modes.split(";") if m)
    unknown = [m for m in cfg.modes if m.split("@")[0] not in MODES]
    if unknown:
        raise ConfigError(
            f"--modes: unknown modes {unknown}; choose from {', '.join(MODES)} "
            "(offloadkit bench --list-modes says what each does)"
        )
    if cfg.shape not in LLAMA_SHAPES:
        raise ConfigError(f"--shape {cfg.shape!r} is unknown; choose one of {', '.join(LLAMA_SHAPES)}")
    if device == "cpu":
        _cpu_check(cfg)
    return cfg


def run_bench(args, log=print) -> dict:
    """Run ``offloadkit bench`` as the parsed ``args`` say; returns the report.

    Without a GPU it runs on the CPU with activations offloaded to disk (what saves memory
    there), unless the shape is too large for a CPU, which is one ConfigError line.
    """
    cfg = _bench_config(args)
    if cfg.device == "cpu":
        log(
            f"offloadkit bench on the CPU: {cfg.shape}, {cfg.seq_len} tokens, offloadkit modes to {cfg.storage} "
            f"({cfg.disk_dir or tempfile.gettempdir()})"
        )
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
