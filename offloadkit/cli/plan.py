"""``offloadkit plan``: the planner's table for a model and sequence length, and the longest
sequence that fits this machine's (or the given) budgets."""

from __future__ import annotations

import argparse

from offloadkit.defaults import OPTIMIZER_STATE_BYTES

__all__ = ["add_plan_parser", "run_plan"]

_GiB = 1 << 30


def add_plan_parser(sub) -> argparse.ArgumentParser:
    """Register ``plan`` on the ``offloadkit`` subcommand parser."""
    p = sub.add_parser(
        "plan",
        help="plan a long-context step: placement, tiling, predicted memory and time",
        description="Decide per decoder layer what to keep, offload (RAM or disk) or recompute, the "
        "loss chunks and MLP shards, and predict GPU peak, host RAM, disk and step time; then "
        "search the longest sequence that fits the budgets.",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--shape", help="a built-in shape: tiny, small, llama-3.2-1b, llama-3-8b")
    which.add_argument("--model", help="a Hugging Face model directory (its config.json is read)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument(
        "--lora-rank", type=int, default=16, help="LoRA rank on every linear layer; 0: full fine-tune (default 16)"
    )
    p.add_argument(
        "--optimizer-precision",
        choices=tuple(OPTIMIZER_STATE_BYTES),
        default="params",
        help="a full fine-tune's AdamW state: moments in the weights' dtype (params), bf16 moments with "
        "stochastic rounding (compact), or fp32 master weights and moments (fp32_master)",
    )
    p.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="a full fine-tune's gradient clipping, as TrainingArguments.max_grad_norm (default 1.0, the "
        "Trainer's): with the AdamW state in host memory, clipping holds every gradient until step(); 0 "
        "updates each parameter in backward",
    )
    p.add_argument("--layers", type=int, default=None, help="override the depth (same layer shape)")
    p.add_argument("--gpu-gib", type=float, default=None, help="GPU budget (default: this GPU's memory less 1 GiB)")
    p.add_argument(
        "--host-gib", type=float, default=None, help="host RAM budget (default: available RAM less the kept-free share)"
    )
    p.add_argument("--disk-gib", type=float, default=None, help="disk budget (default: free space in --disk-dir)")
    p.add_argument("--disk-dir", default=None, help="spill directory whose free space is the disk budget")
    p.add_argument(
        "--measure",
        action="store_true",
        help="time PCIe copies, disk I/O and the model's attention here instead of the defaults",
    )
    p.add_argument("--no-search", action="store_true", help="skip the longest-sequence search")
    return p


def _gib(value: float | None, name: str) -> int | None:
    if value is None:
        return None
    if value <= 0:
        raise ValueError(f"--{name}={value!r} must be positive")
    return int(value * _GiB)


def run_plan(args, log=print) -> int:
    from offloadkit.planning import Budgets, OptimizerSetup, longest_sequence, plan

    if args.seq_len < 1 or args.batch < 1:
        raise ValueError(f"--seq-len={args.seq_len} and --batch={args.batch} must be >= 1")
    if not args.max_grad_norm >= 0:
        raise ValueError(f"--max-grad-norm={args.max_grad_norm} must be >= 0 (0: no clipping)")
    clipping = args.max_grad_norm > 0
    optimizer = OptimizerSetup(
        updates_in_backward=not clipping,
        source=f"--max-grad-norm {args.max_grad_norm:g}"
        + (", the Trainer's default" if args.max_grad_norm == 1.0 else ""),
    )
    budgets = Budgets.detect(
        gpu_bytes=_gib(args.gpu_gib, "gpu-gib"),
        host_bytes=_gib(args.host_gib, "host-gib"),
        disk_bytes=_gib(args.disk_gib, "disk-gib"),
        disk_dir=args.disk_dir,
    )
    model = args.model or args.shape
    if args.measure:
        from offloadkit.planning import resolve_shape

        budgets = budgets.measure(
            disk_dir=args.disk_dir, shape=resolve_shape(model, args.layers), lora_rank=args.lora_rank
        )
    common = {
        "batch": args.batch,
        "lora_rank": args.lora_rank,
        "budgets": budgets,
        "layers": args.layers,
        "optimizer_precision": args.optimizer_precision,
        "optimizer": optimizer,
    }
    p = plan(model, args.seq_len, **common)
    log(p.table())
    log("")
    log("budgets: " + ", ".join(f"{k}: {v}" for k, v in budgets.source.items()))
    if not args.lora_rank:
        log(f"optimizer, with its state in host memory: {optimizer.describe()}")
    log("config keys: " + ", ".join(f"{k}={v}" for k, v in p.to_config().items()))
    if not args.no_search:
        cap = longest_sequence(model, **common)
        log(cap.summary())
    return 0 if p.fits else 1
