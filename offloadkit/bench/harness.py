"""Side-by-side training-step benchmark of memory-saving modes on one model shape.

Every mode runs in the same process on the same model and batch: warm-up steps first,
then timed steps with the device synchronised around each; reported figures are the
median step time, tokens/s, peak allocated and reserved device memory (reset before the
timed steps), peak host RSS, and the engine's own counters where it is involved.
"""

from __future__ import annotations

import contextlib
import gc
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import psutil
import torch

from offloadkit.bench.modes import MODES, ModeSetup
from offloadkit.bench.provenance import provenance
from offloadkit.bench.rss import PeakRss
from offloadkit.defaults import MAX_FWD_STASH_SIZE, STREAM_DEPTH
from offloadkit.models.zoo import LLAMA_SHAPES, build_llama

__all__ = ["BenchConfig", "ModeResult", "run_benchmark", "measure_copy_bandwidth", "format_table"]

GiB = float(1 << 30)


@dataclass
class BenchConfig:
    shape: str = "llama-3.2-1b"
    seq_len: int = 16384
    batch: int = 1
    lora_rank: int | None = None  # None: full fine-tune
    modes: tuple[str, ...] = ("none", "ckpt", "ckpt+offload", "offload", "ckpt+save_on_cpu", "save_on_cpu")
    warmup: int = 2
    steps: int = 5
    dtype: str = "bfloat16"
    attn_implementation: str = "sdpa"
    prefetch: int | None = None
    prefetch_bytes: int | None = None
    max_fwd_stash_size: int = MAX_FWD_STASH_SIZE
    stream_depth: int = STREAM_DEPTH
    storage: str = "ram"  # ram | disk | tiered, for the offloadkit modes
    disk_dir: str | None = None
    host_budget_gib: float | None = None
    device: str = "cuda"
    seed: int = 0


@dataclass
class ModeResult:
    mode: str
    status: str = "ok"  # ok | oom | skipped | error
    note: str = ""
    step_s: float | None = None
    step_times_s: list = field(default_factory=list)
    tokens_per_s: float | None = None
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    peak_host_rss_gib: float | None = None
    loss: float | None = None
    loss_bits_equal_reference: bool | None = None
    grad_norm: float | None = None
    offload: dict | None = None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _on_cuda(cfg: "BenchConfig") -> bool:
    return cfg.device.startswith("cuda")


def measure_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Pinned host<->device copy bandwidth in GB/s (median of ``repeats``)."""
    if not torch.cuda.is_available():
        return {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        times = []
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        out[f"{name}_gb_s"] = round(nbytes / statistics.median(times[1:]) / 1e9, 2)
    del dev, host
    return out


def _build(cfg: BenchConfig):
    dtype = getattr(torch, cfg.dtype)
    model = build_llama(
        cfg.shape, dtype=dtype, device=cfg.device, seed=cfg.seed, attn_implementation=cfg.attn_implementation
    )
    model.config.use_cache = False
    if cfg.lora_rank:
        from offloadkit.integrations.peft_utils import apply_lora

        model = apply_lora(model, rank=cfg.lora_rank)
    model.train()
    gen = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, model.config.vocab_size, (cfg.batch, cfg.seq_len), generator=gen).to(cfg.device)
    return model, {"input_ids": ids, "labels": ids.clone()}


def _step(model, batch, ctx_factory: Callable[[], contextlib.AbstractContextManager]):
    model.zero_grad(set_to_none=True)
    with ctx_factory():
        loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def _grad_norm(model) -> float:
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


def _run_mode(cfg: BenchConfig, model, batch, setup: ModeSetup, ref_loss) -> ModeResult:
    res = ModeResult(setup.name)
    if setup.enable is None:
        raise ValueError(f"mode {setup.name!r} has no in-process setup; run it with benchmarks/capacity.py")
    handle = setup.enable(model, cfg)
    try:
        for _ in range(cfg.warmup):
            _step(model, batch, handle.context)
        _sync(cfg.device)
        if handle.stats_reset is not None:
            handle.stats_reset()
        if _on_cuda(cfg):
            torch.cuda.reset_peak_memory_stats()
        # The peak of the timed steps, also in their middle (not RSS read between steps).
        rss = PeakRss().start()
        times = []
        loss = None
        for _ in range(cfg.steps):
            _sync(cfg.device)
            t0 = time.perf_counter()
            loss = _step(model, batch, handle.context)
            _sync(cfg.device)
            times.append(time.perf_counter() - t0)
        rss_peak = rss.stop()
        res.step_times_s = [round(t, 4) for t in times]
        res.step_s = statistics.median(times)
        res.tokens_per_s = cfg.batch * cfg.seq_len / res.step_s
        if _on_cuda(cfg):
            res.peak_allocated_gib = torch.cuda.max_memory_allocated() / GiB
            res.peak_reserved_gib = torch.cuda.max_memory_reserved() / GiB
        res.peak_host_rss_gib = rss_peak / GiB
        res.loss = float(loss)
        res.grad_norm = _grad_norm(model)
        if ref_loss is not None:
            # float32 scalars convert to Python floats exactly: equality is bitwise equality
            res.loss_bits_equal_reference = res.loss == ref_loss
        if handle.stats is not None:
            res.offload = handle.stats()
    except torch.cuda.OutOfMemoryError as exc:
        res.status, res.note = "oom", str(exc).split("\n")[0][:200]
    finally:
        handle.disable()
        model.zero_grad(set_to_none=True)
        gc.collect()
        if _on_cuda(cfg):
            torch.cuda.empty_cache()
    return res


def run_benchmark(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run every mode of ``cfg`` and return a JSON-serialisable report."""
    if cfg.shape not in LLAMA_SHAPES:
        raise ValueError(f"shape={cfg.shape!r} is unknown; choose one of {sorted(LLAMA_SHAPES)}")
    unknown = [m for m in cfg.modes if m.split("@")[0] not in MODES]
    if unknown:
        raise ValueError(f"modes {unknown} are unknown; choose from {sorted(MODES)}")
    model, batch = _build(cfg)
    shape = LLAMA_SHAPES[cfg.shape]
    report = {
        "config": asdict(cfg),
        "device": torch.cuda.get_device_name()
        if _on_cuda(cfg)
        else f"CPU {platform.processor() or platform.machine()}",
        "torch": torch.__version__,
        "host_ram_gib": psutil.virtual_memory().total / GiB,
        "copy_bandwidth": measure_copy_bandwidth(),
        "checkpoint_input_bytes": shape["num_hidden_layers"] * cfg.batch * cfg.seq_len * shape["hidden_size"] * 2,
        "results": [],
    }
    ref_loss = None  # loss of the first mode that ran: every mode must match it bit for bit
    for spec in cfg.modes:
        name, mode_cfg = _mode_config(cfg, spec)
        setup = MODES[name]
        skip = setup.skip_reason(mode_cfg) if setup.skip_reason else None
        if skip:
            res = ModeResult(spec, status="skipped", note=skip)
        else:
            res = _run_mode(mode_cfg, model, batch, setup, ref_loss)
            res.mode = spec
            if ref_loss is None and res.status == "ok":
                ref_loss, res.loss_bits_equal_reference = res.loss, True
        report["results"].append(asdict(res))
        log(_row(res))
    return report


def _mode_config(cfg: BenchConfig, spec: str) -> tuple[str, BenchConfig]:
    """``"ckpt+offload@prefetch=4,prefetch_bytes=1g"`` -> base mode and a config copy with overrides."""
    name, _, overrides = spec.partition("@")
    if not overrides:
        return name, cfg
    fields = dict(asdict(cfg))
    for item in overrides.split(","):
        key, _, value = item.partition("=")
        if key not in fields:
            raise ValueError(f"mode {spec!r}: unknown setting {key!r}; settings are {sorted(fields)}")
        scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(value[-1:].lower())
        if scale and value[:-1].replace(".", "", 1).isdigit():
            fields[key] = int(float(value[:-1]) * scale)
        elif value.lower() == "none":
            fields[key] = None
        elif fields[key] is not None:
            fields[key] = type(fields[key])(value)
        else:
            fields[key] = _number_or_text(value)
    return name, BenchConfig(**fields)


def _number_or_text(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _row(r: ModeResult) -> str:
    if r.status != "ok":
        return f"{r.mode:<22} {r.status}: {r.note}"
    extra = ""
    if r.offload:
        extra = (
            f"  offl {r.offload['offloaded_bytes'] / GiB:6.2f} GiB  wait {r.offload['wait_seconds']:.3f}s"
            f"  hit/miss {r.offload['prefetch_hits']}/{r.offload['prefetch_misses']}"
        )
        disk = (r.offload.get("storage") or {}).get("disk")
        if disk:
            extra += (
                f"  disk w {disk['bytes_written'] / GiB:.2f} GiB @ {disk['write_gb_s']:.2f} GB/s"
                f" r {disk['bytes_read'] / GiB:.2f} GiB @ {disk['read_gb_s']:.2f} GB/s"
            )
        if "layer_stream" in r.offload:
            ls = r.offload["layer_stream"]
            extra += (
                f"  streamed {ls['streamed_bytes'] / GiB:.2f} GiB pool {ls['pool_bytes'] / GiB:.2f} GiB"
                f" misses {ls['misses']} resident<={ls['max_resident']}"
            )
    return (
        f"{r.mode:<18} {r.step_s:7.3f} s  {r.tokens_per_s:9.0f} tok/s  alloc {_gib(r.peak_allocated_gib)}"
        f"  resv {_gib(r.peak_reserved_gib)}  rss {_gib(r.peak_host_rss_gib)}"
        f"  loss= {r.loss_bits_equal_reference}{extra}"
    )


def _bandwidth(measured: dict) -> str:
    return ", ".join(f"{k.removesuffix('_gb_s')} {v:.1f} GB/s" for k, v in measured.items())


def _gib(x) -> str:
    return "   n/a" if x is None else f"{x:6.2f}"


def format_table(report: dict) -> str:
    """Markdown table of a report."""
    lines = [
        f"{report['config']['shape']}, seq {report['config']['seq_len']}, "
        f"{'LoRA r=' + str(report['config']['lora_rank']) if report['config']['lora_rank'] else 'full fine-tune'}; "
        f"{report['device']}, torch {report['torch']}"
        + (f"; copy bandwidth {_bandwidth(report['copy_bandwidth'])}" if report.get("copy_bandwidth") else ""),
        "",
        "| mode | step s | tokens/s | peak alloc GiB | peak reserved GiB | host RSS GiB | loss bits equal | "
        "offloaded GiB | waited s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r['status']} | | | | | | | {r['note'][:60]} |")
            continue
        off = r.get("offload") or {}
        lines.append(
            f"| {r['mode']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {_gib(r['peak_allocated_gib']).strip()} | "
            f"{_gib(r['peak_reserved_gib']).strip()} | {r['peak_host_rss_gib']:.2f} | "
            f"{r['loss_bits_equal_reference']} | "
            f"{off.get('offloaded_bytes', 0) / GiB:.2f} | {off.get('wait_seconds', 0):.3f} |"
        )
    return "\n".join(lines)


def save_report(report: dict, path: str) -> None:
    """Write ``report`` as JSON, with the run's provenance (commit, GPU, versions, command line)
    under ``"provenance"`` unless the report has its own."""
    report = {**report, "provenance": report.get("provenance") or provenance()}
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
