"""``offloadkit plan``: whether a step of a model and sequence length fits this machine's (or the
given) budgets, the config keys that realise the plan as YAML to paste into a config, the
predicted step time, and the longest sequence that fits; ``--verbose`` adds the planner's table
and the candidates not chosen. With ``--world-size N`` the plan is one rank's of N splitting each
sequence (context parallelism; ``--seq-len`` stays the whole sequence), within its share of the
host's RAM and disk (``--ranks-per-host`` ranks share them), with the ring attention rotation it
takes (``--rotation``)."""

from __future__ import annotations

import argparse
from dataclasses import replace

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
    which.add_argument("--shape", help=f"a built-in shape: {', '.join(_shapes())}")
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
    p.add_argument(
        "--fused-lora",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the LoRA layers run fused in the compute dtype (fused_lora: true): they save less per layer; "
        "default: fused with LoRA, as offload_plan: auto runs a 16-bit plain LoRA model (--no-fused-lora: PEFT's)",
    )
    p.add_argument("--layers", type=int, default=None, help="override the depth (same layer shape)")
    p.add_argument("--gpu-gib", type=float, default=None, help="GPU budget (default: this GPU's memory less 1 GiB)")
    p.add_argument(
        "--host-gib", type=float, default=None, help="host RAM budget (default: available RAM less the kept-free share)"
    )
    p.add_argument("--disk-gib", type=float, default=None, help="disk budget (default: free space in --disk-dir)")
    p.add_argument("--disk-dir", default=None, help="spill directory whose free space is the disk budget")
    p.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="GPUs of the run, each sequence split over them (context parallelism, unless "
        "--no-context-parallel); the plan is one rank's and --seq-len the whole sequence (default 1)",
    )
    p.add_argument(
        "--ranks-per-host",
        type=int,
        default=None,
        help="ranks on one host, sharing its RAM and disk: each plans on the host's budgets divided by this "
        "(default: --world-size, one host)",
    )
    p.add_argument(
        "--no-context-parallel",
        action="store_true",
        help="with --world-size: each rank trains its own sequences of --seq-len tokens (DDP) instead of a "
        "share of one; only host RAM and disk are shared",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="with --world-size: FSDP2 shards the weights, gradients and optimizer state over the ranks "
        "(fully_shard on each decoder layer, then the model); the plan streams no weights then",
    )
    p.add_argument(
        "--rotation",
        choices=("auto", "allgather", "alltoall"),
        default="auto",
        help="with --world-size: how ring attention moves keys and values between the ranks (apply_context_parallel's "
        "rotation): allgather (one all-gather a layer), alltoall (one exchange a ring step: less GPU memory), or "
        "auto: all-gather where it fits and is as fast, else all-to-all (default auto)",
    )
    p.add_argument(
        "--link-gb-s",
        type=float,
        default=None,
        help="GB/s each way between the ranks of a sequence, for ring attention's keys and values (default "
        "150 within a host, as NVLink on H100 SXM; 40 between hosts; GPUs on PCIe alone exchange far slower)",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="time PCIe copies, disk I/O and the model's attention here instead of the defaults",
    )
    p.add_argument("--no-search", action="store_true", help="skip the longest-sequence search")
    p.add_argument(
        "--verbose", action="store_true", help="also the planner's table: placement, memory parts, rates, not chosen"
    )
    return p


def _shapes() -> list[str]:
    """The built-in shape names :func:`~offloadkit.planning.resolve_shape` accepts."""
    from offloadkit.models.zoo import LLAMA_SHAPES

    return list(LLAMA_SHAPES)


def _yaml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if value is None:
        return "null"
    return str(value)


def config_yaml(keys: dict) -> list[str]:
    """``key: value`` lines of the config keys that differ from their defaults (YAML)."""
    from offloadkit.config import OffloadConfig

    defaults = OffloadConfig().to_dict()
    lines = []
    for key, value in keys.items():
        default = defaults.get(key, object())
        if isinstance(default, tuple):
            default = list(default)
        if (list(value) if isinstance(value, tuple) else value) == default:
            continue
        lines.append(f"{key}: {_yaml_value(value)}")
    return lines


def verdict(p) -> str:
    """``fits: <plan>, GPU x/y GiB, host ..., disk ...``, or ``does not fit: <budget> needs X GiB of Y``;
    over several GPUs led by ``per rank of N (...): ``."""
    from offloadkit.planning.memory import HOST_BASELINE_BYTES

    w = p.workload
    ranks = f"{w.parallel.describe(w.seq_len)}: " if w.parallel.world_size > 1 else ""
    if not p.fits:
        return ranks + "does not fit: " + "; ".join(p.reasons)
    m, b = p.memory, p.budgets
    host = m.host - HOST_BASELINE_BYTES  # the budget is what the process may add
    return ranks + (
        f"fits: {p.name}, GPU {m.gpu_reserved / _GiB:.1f}/{b.gpu_bytes / _GiB:.1f} GiB, host "
        f"{host / _GiB:.1f}/{b.host_bytes / _GiB:.1f} GiB, disk {m.disk / _GiB:.1f}/{b.disk_bytes / _GiB:.1f} GiB"
    )


def _parallelism(args):
    """The run's ranks from ``--world-size``, ``--ranks-per-host``, ``--no-context-parallel`` and
    ``--fsdp``."""
    from offloadkit.planning.parallelism import Parallelism

    for flag, value in (("world-size", args.world_size), ("ranks-per-host", args.ranks_per_host)):
        if value is not None and value < 1:
            raise ValueError(f"--{flag}={value} must be >= 1")
    if getattr(args, "fsdp", False) and args.world_size < 2:
        raise ValueError("--fsdp shards the weights over the ranks: give --world-size 2 or more")
    return Parallelism(
        world_size=args.world_size,
        context_parallel=args.world_size > 1 and not args.no_context_parallel,
        ranks_per_host=args.ranks_per_host if args.ranks_per_host is not None else args.world_size,
        rotation=args.rotation,
        shard_weights=bool(getattr(args, "fsdp", False)),
    )


def _gib(value: float | None, name: str) -> int | None:
    if value is None:
        return None
    if value <= 0:
        raise ValueError(f"--{name}={value!r} must be positive")
    return int(value * _GiB)


def run_plan(args, log=print) -> int:
    from offloadkit.kernels.component import llama_auto_kernels
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
    parallel = _parallelism(args)
    if args.link_gb_s is not None and not args.link_gb_s > 0:
        raise ValueError(f"--link-gb-s={args.link_gb_s} must be positive")
    parallel.check_seq_len(args.seq_len)
    budgets = Budgets.detect(
        gpu_bytes=_gib(args.gpu_gib, "gpu-gib"),
        host_bytes=_gib(args.host_gib, "host-gib"),
        disk_bytes=_gib(args.disk_gib, "disk-gib"),
        disk_dir=args.disk_dir,
        ranks_per_host=parallel.ranks_per_host,
    )
    model = args.model or args.shape
    if args.measure:
        from offloadkit.planning import resolve_shape

        budgets = budgets.measure(
            disk_dir=args.disk_dir, shape=resolve_shape(model, args.layers), lora_rank=args.lora_rank
        )
    if args.link_gb_s is not None:
        link = args.link_gb_s * 1e9
        budgets = budgets.with_rates(replace(budgets.rates, link_bytes_per_s=link, network_bytes_per_s=link))
    common = {
        "batch": args.batch,
        "lora_rank": args.lora_rank,
        "budgets": budgets,
        "layers": args.layers,
        "optimizer_precision": args.optimizer_precision,
        "optimizer": optimizer,
        "parallel": parallel,
        "fused_lora": args.fused_lora if args.fused_lora is not None else bool(args.lora_rank),
        # Liger's kernels where a run here would have them (offload_plan: auto turns them on),
        # and the attention kernel --measure found fastest (ring attention picks its own).
        "options": llama_auto_kernels() + (() if parallel.splits_sequence else _measured_attention_kernel(budgets)),
    }
    p = plan(model, args.seq_len, **common)
    w, t = p.workload, p.time
    log(verdict(p))
    log("")
    log("# offloadkit config keys for this plan" + ("" if p.fits else " (it does not fit)"))
    if parallel.splits_sequence:
        log(
            f"# the plan of one rank of {parallel.world_size} splitting each sequence (apply_context_parallel): "
            f"seq_len is the whole sequence, {w.tokens // w.batch} tokens of it on each rank"
        )
    elif parallel.world_size > 1:
        log(f"# the plan of one rank of {parallel.world_size}, each training its own sequences")
    keys = {"seq_len": args.seq_len, **({"batch_size": args.batch} if args.batch != 1 else {}), **p.to_config()}
    if p.workload.parallel.context_parallel and p.workload.parallel.world_size > 1:
        keys["context_parallel"] = True  # the Trainer mixins and offloadkit train split each sequence
    for line in config_yaml(keys):
        log(line)
    log("")
    if parallel.world_size == 1:
        log(
            f"predicted step time: {t.seconds:.2f} s ({t.bound}-bound), {w.tokens / t.seconds:.0f} tokens/s, "
            f"{t.flops / t.seconds / 1e12:.0f} TFLOP/s"
        )
    else:
        # Every rank steps together: the run's tokens/s are every rank's tokens over one step.
        run_tokens = w.tokens * parallel.world_size
        log(
            f"predicted step time: {t.seconds:.2f} s ({t.bound}-bound), {run_tokens / t.seconds:.0f} tokens/s "
            f"across the {parallel.world_size} ranks, {t.flops / t.seconds / 1e12:.0f} TFLOP/s on each"
        )
    if parallel.splits_sequence:
        from offloadkit.planning.parallelism import rotation_name

        rate = budgets.rates.link_bytes_per_s if parallel.one_host else budgets.rates.network_bytes_per_s
        log(
            f"ring attention: {rotation_name(p.rotation)} rotation ({p.rotation_note}), {t.ring_s:.2f} s of keys, "
            f"values and their gradients between the ranks at {rate / 1e9:.0f} GB/s "
            f"({'within the host' if parallel.one_host else 'between hosts'}), {t.ring_wait_s:.2f} s of it not hidden "
            f'behind attention: apply_context_parallel(model, mesh, rotation="{p.rotation}")'
        )
    if not args.lora_rank:
        log(f"optimizer, with its state in host memory: {optimizer.describe()}")
    log("budgets: " + ", ".join(f"{k}: {v}" for k, v in budgets.source.items()))
    if not args.no_search:
        cap = longest_sequence(model, **common)
        if not p.fits:
            across = f", the whole sequence across the {parallel.world_size} ranks" if parallel.splits_sequence else ""
            log(
                f"suggestion: seq_len: {cap.longest} fits these budgets (the longest that does{across})"
                if cap.longest
                else "suggestion: no sequence length fits these budgets; raise --gpu-gib, --host-gib or --disk-gib"
                + (" or --world-size" if parallel.world_size > 1 else "")
            )
        log(cap.summary())
    elif not p.fits:
        log("suggestion: run without --no-search for the longest sequence that fits these budgets")
    if args.verbose:
        log("")
        log(p.table())
    return 0 if p.fits else 1


def _measured_attention_kernel(budgets) -> tuple:
    from offloadkit.kernels.options import AttentionKernelOptions

    kernel = budgets.rates.attention_kernel
    return (AttentionKernelOptions(kernel=kernel),) if kernel != "auto" else ()
