"""Capacity benchmark: the longest sequence a training step runs at, per mode, each probe
in its own process (a CUDA OOM or a hung probe cannot poison the next), beside the
planner's prediction of its peak and step time.

Modes (the entries of the one mode table, ``offloadkit/bench/modes.py``; ``hf_ckpt`` is
still read as ``ckpt``):
  ckpt        Hugging Face gradient checkpointing (non-reentrant), the model's own loss.
  everything  offloadkit checkpointing + block inputs offloaded (tiered: pinned RAM up to
              the host budget, then disk) + frozen-layer streaming + chunked loss + tiled MLP.
  in_gpu      everything's checkpointing, chunked loss and tiling with nothing offloaded or
              streamed: the reference for what the offloading machinery costs.
  auto        whatever ``offload_plan: auto`` chooses.

A probe is ``mode:seq_len:layers[:warmup[:steps]]``; ``a|b`` runs the first alternative
whose predicted time fits what is left of ``--budget-s`` (e.g. full depth, else reduced).
One step is forward, backward and AdamW on the LoRA parameters. Before each probe its
time is predicted from the planner's step-time model; probes that would not fit the time
left are skipped and say so.

  PYTHONPATH=$PWD python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 \\
      --probes "ckpt:16384:32:1:2;everything:16384:32:1:2" --budget-s 400 --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import yaml

from offloadkit.bench.modes import MODES, PROBE_MODES
from offloadkit.bench.provenance import provenance

GiB = float(1 << 30)
# Seconds a probe spends outside its steps: interpreter, imports, building the model on the
# GPU, PEFT wrapping, pinning streamed weights. Assumed for the 8B shape at full depth
# (scaled by depth, 8 s floor); checked against the wall times this script records.
SETUP_S_FULL_DEPTH = 30.0
SETUP_S_FLOOR = 8.0
# Measured steps run slower than the planner's model predicts in the first step (kernel
# selection, allocator growth): time budgets use this margin. Assumed.
TIME_MARGIN = 1.3
ALIASES = {"hf_ckpt": "ckpt"}  # the name this script used before the one mode table


# --------------------------------------------------------------------------- planning side
def placement_code(placement: list[str]) -> str:
    """One letter per block input: g(pu), r(am), d(isk), x (dropped, recomputed)."""
    return "".join("x" if where == "recompute" else where[0] for where in placement)


def _counts(mode: str, workload, host_budget: int) -> dict:
    """The planner's counts a probe of ``mode`` runs with (:func:`_options` builds its options
    from them): ``ckpt`` checkpointing alone; ``in_gpu`` the automatic loss chunks and MLP
    shards; ``everything`` those with block inputs offloaded, as many in RAM as the host
    budget holds beside the streamed layers (LoRA)."""
    from offloadkit.planning.memory import auto_loss_chunks, auto_mlp_shards
    from offloadkit.storage.pool import size_class

    w = workload
    if mode == "ckpt":
        return {}
    tiling = dict(
        loss_chunks=auto_loss_chunks(w.tokens, w.shape.vocab),
        mlp_shards=auto_mlp_shards(w.tokens, w.shape.intermediate),
    )
    if mode == "in_gpu":
        return tiling
    streamed = w.shape.layers * size_class(w.shape.layer_params * w.dtype_bytes) if w.lora_rank else 0
    ram_blocks = max(0, (host_budget - streamed) // size_class(w.block_input_bytes))
    return dict(tiling, offload_inputs=True, ram_blocks=ram_blocks, layer_streaming=bool(w.lora_rank))


def _options(
    w,
    *,
    offload_inputs: bool = False,
    layer_streaming: bool = False,
    loss_chunks: int = 0,
    mlp_shards: int = 1,
    tiled_projections: bool = False,
    head_groups: int = 1,
    horizon: int | None = None,
    ram_blocks: int | None = None,
    recompute_blocks: int = 0,
    keep_attention: int = 0,
):
    """A probe's components' options from the planner's counts: every layer checkpointed,
    the loss chunked and the MLP tiled as given, block inputs offloaded (``ram_blocks`` in RAM,
    None: all; the oldest on disk; ``recompute_blocks`` dropped) and fetched ``horizon`` ahead,
    ``keep_attention`` layers' attention outputs kept."""
    from offloadkit.checkpointing.options import CheckpointOptions
    from offloadkit.engine.options import ActivationOptions
    from offloadkit.planning.plan import place_inputs, planned_options, with_options

    c = planned_options(
        w,
        loss_chunks=loss_chunks,
        mlp_shards=mlp_shards,
        tiled_projections=tiled_projections,
        head_groups=head_groups,
        offload_inputs=offload_inputs,
        layer_streaming=layer_streaming,
    )
    c = with_options(c, ActivationOptions, loading_horizon=horizon if offload_inputs else None)
    c = place_inputs(w, c, recompute_blocks=recompute_blocks, ram_blocks=ram_blocks)
    return with_options(c, CheckpointOptions, keep_attention=keep_attention or False)


def predict(
    shape: str,
    mode: str,
    seq: int,
    layers: int,
    lora_rank: int,
    host_budget: int,
    budgets=None,
    recompute_blocks: int | None = None,
) -> dict:
    """The planner's memory and time for a probe (``auto``: the plan it would choose;
    ``everything``: every feature on, with the tiling and prefetch horizon the planner picks
    for the full-depth model, so that a reduced-depth probe holds what a full step holds;
    ``recompute_blocks``: that many block inputs dropped and replayed, whatever the plan says,
    to time the recompute placement against storage at one length)."""
    from offloadkit.checkpointing.footprint import keeps_attention
    from offloadkit.component import OptionSet
    from offloadkit.engine.options import ActivationOptions
    from offloadkit.kernels.component import llama_auto_kernels
    from offloadkit.longctx.options import LongContextOptions
    from offloadkit.planning import Budgets, Workload, estimate_memory, estimate_time, plan, resolve_shape
    from offloadkit.planning.memory import long_context_counts, region_length
    from offloadkit.planning.plan import option
    from offloadkit.planning.planner import _keep_attention

    def chosen(p) -> dict:
        """A plan's counts: its tiling, prefetch horizon and kept attention outputs."""
        chunks, shards, projections, groups = long_context_counts(option(p.options, LongContextOptions))
        return dict(
            loss_chunks=chunks,
            mlp_shards=shards,
            tiled_projections=projections,
            head_groups=groups,
            horizon=option(p.options, ActivationOptions).loading_horizon,
            keep_attention=keeps_attention(p.workload, OptionSet(p.options)),
        )

    budgets = budgets or Budgets.detect(host_bytes=host_budget)
    # What offload_plan: auto runs on the zoo's models: LoRA fused (every layer fuses), and
    # Liger's kernels where liger-kernel and a GPU are there (offloadkit.compose._auto_kernels).
    fused = bool(lora_rank)
    kernels = llama_auto_kernels()
    if mode == "auto":
        p = plan(shape, seq, lora_rank=lora_rank, budgets=budgets, layers=layers, fused_lora=fused, options=kernels)
        m, t, k = p.memory, p.time, chosen(p)
    else:
        w = Workload(resolve_shape(shape, layers), seq, 1, lora_rank)
        k = _counts(mode, w, host_budget)
        if mode in ("everything", "in_gpu"):
            full_plan = plan(shape, seq, lora_rank=lora_rank, budgets=budgets)
            full = chosen(full_plan)
            k.update({n: full[n] for n in ("horizon", "tiled_projections", "head_groups")})
            # Kept attention outputs: as many of the probe's layers as the full plan keeps.
            k["keep_attention"] = min(full["keep_attention"], layers) if mode == "everything" else 0
            if mode == "everything":
                # RAM holds as many as in the full plan where some spill to disk (else all).
                spills = "disk" in full_plan.placement
                k["ram_blocks"] = full_plan.placement.count("ram") if spills else None
            replayed = region_length(full_plan.placement)
            if mode == "everything" and replayed > 1 and layers > replayed:
                # The full plan drops block inputs: the probe holds its longest replayed run.
                k["recompute_blocks"] = replayed - 1
            if mode == "everything" and recompute_blocks is not None:
                k["recompute_blocks"] = recompute_blocks
            if k["keep_attention"]:
                # No more than the probe's own RAM holds beside what it keeps there (everything
                # mode streams the layers, which the full plan may not).
                own = _options(w, **{**k, "keep_attention": 0})
                om = estimate_memory(w, own)
                kept = _keep_attention(w, own, budgets, estimate_time(w, own, budgets.rates, om.block_placement))
                held = keeps_attention(w, OptionSet(kept[0])) if kept else 0
                k["keep_attention"] = min(k["keep_attention"], held)
        f = _options(w, **k)
        m = estimate_memory(w, f)
        t = estimate_time(w, f, budgets.rates, m.block_placement)
    return {
        "peak_gib": m.gpu_peak / GiB,
        "reserved_gib": m.gpu_reserved / GiB,
        "host_gib": m.host / GiB,
        "disk_gib": m.disk / GiB,
        "step_s": t.seconds,
        "bound": t.bound,
        "flops": t.flops,
        # The model's parts: attention and linear compute at the rates it was given.
        "attention_s": t.attention_flops / budgets.rates.attention_flops_per_s,
        "linear_s": t.linear_flops
        / budgets.rates.linear_flops_per_s(fused and mode == "auto", 2 * len(kernels) if mode == "auto" else 0),
        "placement": placement_code(m.block_placement),
        "loss_chunks": k.get("loss_chunks", 0),
        "mlp_shards": k.get("mlp_shards", 1),
        "tiled_projections": k.get("tiled_projections", False),
        "horizon": k.get("horizon"),
        "keep_attention": k.get("keep_attention", 0),
        "head_groups": k.get("head_groups", 1),
        "fits_gpu": m.gpu_reserved <= budgets.gpu_bytes,
    }


def full_depth(shape: str, mode: str, seq: int, layers: int, lora_rank: int, host_budget: int, budgets) -> dict:
    """What a probe of ``layers`` layers would need at the model's depth (:func:`predict`). A
    reduced-depth ``everything`` probe stands for the planner's full-depth run, its block inputs
    in RAM, on disk or replayed: that plan's figures, not those of every input stored."""
    from offloadkit.planning import resolve_shape

    full_layers = resolve_shape(shape).layers
    mode = "auto" if mode == "everything" and layers < full_layers else mode
    return predict(shape, mode, seq, full_layers, lora_rank, host_budget, budgets)


# --------------------------------------------------------------------------- child side
def grad_norm(params) -> float | None:
    """The global L2 norm of ``params``' gradients (None where backward left none: updated in
    backward); read, never written, so the step it is taken in is the one timed."""
    import torch

    norms = [torch.linalg.vector_norm(q.grad.float()) for q in params if q.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else None


def time_steps(step, warmup: int, steps: int, out: dict, after_warmup=None, last=None, cuda: bool = True) -> None:
    """Run ``warmup`` steps, then ``steps`` synchronised timed ones, into ``out``: each step's
    seconds, the median, its loss, peak GPU memory since the warm-up (allocated, reserved), the
    process's peak RSS over it all; a CUDA out-of-memory as status "oom". ``after_warmup()``
    runs before the timing starts; ``last(step)``, given, runs the last step instead (not
    timed: a profiled or recorded one)."""
    import torch

    from offloadkit.bench.rss import PeakRss

    rss = PeakRss(interval=0.05).start()
    try:
        for _ in range(warmup):
            step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if after_warmup is not None:
            after_warmup()
        times = []
        for i in range(steps):
            if last is not None and i == steps - 1:
                last(step)
                continue
            t0 = time.perf_counter()
            out["loss"] = step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out["step_times_s"] = [round(x, 3) for x in times]
        out["step_s"] = sorted(times)[len(times) // 2] if times else None
        if cuda:
            out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
            out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    except torch.cuda.OutOfMemoryError as exc:
        out["status"], out["note"] = "oom", str(exc).split("\n")[0][:160]
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    finally:
        out["host_rss_gib"] = rss.stop() / GiB


def run_probe(spec: dict) -> dict:
    """One probe in this process: build, attach the mode, warm up, time the steps."""
    import torch

    from offloadkit.compose import prepare
    from offloadkit.integrations.peft_utils import apply_lora
    from offloadkit.models.zoo import build_llama

    mode, seq, layers = spec["mode"], spec["seq_len"], spec["layers"]
    out: dict = {"status": "ok"}
    t_setup = time.perf_counter()
    model = build_llama(
        spec["shape"],
        dtype=torch.bfloat16,
        device="cuda",
        attn_implementation="sdpa",
        num_hidden_layers=layers,
        max_position_embeddings=max(seq, 131072),
    )
    model.config.use_cache = False
    if spec["lora_rank"]:
        model = apply_lora(model, rank=spec["lora_rank"])
    model.train()
    runtime = None
    setup = MODES[mode]
    if setup.config is None:
        cap = spec.get("extra", {}).get("gpu_budget_bytes")
        if cap is not None:  # what prepare() does for the other modes
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.get_device_properties(0).total_memory))
        setup.enable(model, None)  # an in-process mode (ckpt: Hugging Face checkpointing)
    else:
        config = {**setup.config({**spec, "seq_len": seq}), **spec.get("extra", {})}
        runtime = prepare(model, config)
        out["config"] = {k: v for k, v in runtime.config.to_dict().items() if v not in (None, False)}
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda")
    out["setup_s"] = time.perf_counter() - t_setup

    def step():
        ctx = runtime.context() if runtime is not None else torch.enable_grad()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out["grad_norm"] = grad_norm(params)  # the last step's, beside its loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    def after_warmup():
        if runtime is not None and runtime.manager is not None:
            runtime.manager.reset_stats()

    def recorded(step):  # the last step's allocations, for what is alive at its peak (slower: not timed)
        from explain_peak import recorded_step

        loss, out["peak_breakdown"] = recorded_step(step)
        if loss is not None:
            out["loss"] = loss

    time_steps(step, spec["warmup"], spec["steps"], out, after_warmup, recorded if spec.get("breakdown") else None)
    if runtime is not None:  # the timed steps' totals, before any profiled step
        report = runtime.report()
        storage = report.get("storage") or {}
        disk = storage.get("disk") or {}
        out["disk_written_gib"] = disk.get("bytes_written", 0) / GiB
        out["offloaded_gib"] = report.get("activations", {}).get("offloaded_bytes", 0) / GiB
        out["tiered"] = storage.get("tiered")
        # Where backward's copies came from: hits, misses (a fetch at the moment of need) and
        # each prefetch lane's totals, to read a kernel breakdown's waits by.
        acts = report.get("activations", {})
        out["engine"] = {k: acts[k] for k in ("prefetch_hits", "prefetch_misses", "stash_hits") if k in acts}
        out["engine"]["lanes"] = report.get("prefetch", {}).get("lanes")
    if spec.get("kernel_breakdown") and out["status"] == "ok":
        # One more step, profiled: not timed with the others, and its failure is its own.
        from kernel_time import profile_step

        try:
            out["kernel_breakdown"] = profile_step(step, launches=spec.get("copy_launches", False))
        except torch.cuda.OutOfMemoryError as exc:
            out["kernel_breakdown"] = {"note": "oom: " + str(exc).split("\n")[0][:160]}
    if runtime is not None:
        runtime.close()
    return out


# --------------------------------------------------------------------------- parent side
def _parse(probes: str, default_warmup: int, default_steps: int) -> list[list[dict]]:
    groups = []
    for group in filter(None, (g.strip() for g in probes.split(";"))):
        alts = []
        for alt in group.split("|"):
            parts = alt.split(":")
            parts[0] = ALIASES.get(parts[0], parts[0])
            if len(parts) < 3 or parts[0] not in PROBE_MODES:
                raise SystemExit(
                    f"capacity: probe {alt!r} is not mode:seq_len:layers[:warmup[:steps]] with mode in {PROBE_MODES}"
                )
            nums = [int(x) for x in parts[1:]]
            alts.append(
                {
                    "mode": parts[0],
                    "seq_len": nums[0],
                    "layers": nums[1],
                    "warmup": nums[2] if len(nums) > 2 else default_warmup,
                    "steps": nums[3] if len(nums) > 3 else default_steps,
                }
            )
        groups.append(alts)
    return groups


def _setup_s(layers: int, full: int) -> float:
    return max(SETUP_S_FLOOR, SETUP_S_FULL_DEPTH * layers / full)


def _detect_budgets(args) -> dict:
    from offloadkit.planning import Budgets, resolve_shape

    budgets = Budgets.detect(
        gpu_bytes=int(args.gpu_gib * GiB) if args.gpu_gib else None,
        host_bytes=int(args.host_budget_gib * GiB) if args.host_budget_gib else None,
        disk_dir=args.disk_dir,
    )
    try:
        budgets = budgets.measure(disk_dir=args.disk_dir, shape=resolve_shape(args.shape), lora_rank=args.lora_rank)
    except Exception as exc:  # keep the defaults where timing is impossible
        print(f"capacity: rates not measured ({exc}); using defaults", file=sys.stderr, flush=True)
    return {
        "gpu": budgets.gpu_bytes,
        "host": budgets.host_bytes,
        "disk": budgets.disk_bytes,
        "rates": budgets.rates.__dict__,
        "source": budgets.source,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--probes", required=False, default="")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget for all probes")
    ap.add_argument(
        "--host-budget-gib",
        type=float,
        default=None,
        help="pinned RAM for block inputs and streamed weights (default: available RAM less 16 GiB)",
    )
    ap.add_argument("--disk-dir", default=None)
    ap.add_argument(
        "--gpu-gib",
        type=float,
        default=None,
        help="cap each probe, and the plan, to this much GPU memory (e.g. 79: an H100's on a larger card)",
    )
    ap.add_argument(
        "--peak-breakdown",
        action="store_true",
        help="record the last step's allocations and list what is alive at its peak (that step is not timed)",
    )
    ap.add_argument(
        "--kernel-breakdown",
        action="store_true",
        help="profile one more step and group its GPU time (attention, gemm, copies, other; idle)",
    )
    ap.add_argument(
        "--copy-launches",
        action="store_true",
        help="with --kernel-breakdown: also the host's CUDA calls, to size each copy in a wait and say when it "
        "was asked for (the host runs slower under it)",
    )
    ap.add_argument(
        "--recompute-blocks",
        type=int,
        default=None,
        help="everything probes: drop and replay this many block inputs (0: none), whatever the plan says",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config key on top of each probe's mode (YAML value), e.g. attention_kernel=fa4",
    )
    ap.add_argument("--out", default="capacity-results")
    ap.add_argument("--name", default="capacity")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budgets-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    extra = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item}: write KEY=VALUE")
        extra[key] = yaml.safe_load(value)
    if args.gpu_gib is not None:
        extra.setdefault("gpu_budget_bytes", int(args.gpu_gib * GiB))
    if args.budgets_only:
        print("BUDGETS " + json.dumps(_detect_budgets(args)), flush=True)
        return 0
    if args.child is not None:
        spec = json.loads(args.child)
        try:
            result = run_probe(spec)
        except Exception as exc:  # reported as a result, not a traceback in the table
            result = {"status": "error", "note": f"{type(exc).__name__}: {str(exc)[:200]}"}
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    import psutil

    from offloadkit.planning import Budgets, Rates, longest_sequence, resolve_shape

    start = time.monotonic()
    full_layers = resolve_shape(args.shape).layers
    host_budget = (
        int(args.host_budget_gib * GiB)
        if args.host_budget_gib is not None
        else max(1 << 30, int(psutil.virtual_memory().available - 16 * GiB))
    )
    # Read and time the machine in a child: a CUDA context in this process would take GPU
    # memory from every probe.
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--budgets-only", "--host-budget-gib", str(host_budget / GiB)]
        + (["--disk-dir", args.disk_dir] if args.disk_dir else [])
        + (["--gpu-gib", str(args.gpu_gib)] if args.gpu_gib is not None else []),
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("BUDGETS ")]
    if not found:
        raise SystemExit(f"capacity: reading the budgets failed: {proc.stderr.strip()[-300:]}")
    data = json.loads(found[-1][8:])
    budgets = Budgets(data["gpu"], data["host"], data["disk"], Rates(**data["rates"]), data["source"])
    cap = longest_sequence(args.shape, lora_rank=args.lora_rank, budgets=budgets)
    report = {
        "shape": args.shape,
        "lora_rank": args.lora_rank,
        "budgets": {
            "gpu_gib": budgets.gpu_bytes / GiB,
            "host_gib": budgets.host_bytes / GiB,
            "disk_gib": budgets.disk_bytes / GiB,
            "source": budgets.source,
            "rates": budgets.rates.__dict__,
        },
        "capacity": cap.summary(),
        "full_depth_plan": cap.plan.table() if cap.plan else None,
        "probes": [],
    }
    import torch

    report["device"] = budgets.source.get("gpu", "")  # names the GPU without a CUDA context here
    report["torch"] = torch.__version__
    print(cap.summary(), flush=True)
    os.makedirs(args.out, exist_ok=True)
    for alts in _parse(args.probes, args.warmup, args.steps):
        chosen, skipped = None, []
        for alt in alts:
            pred = predict(
                args.shape,
                alt["mode"],
                alt["seq_len"],
                alt["layers"],
                args.lora_rank,
                host_budget,
                budgets,
                recompute_blocks=args.recompute_blocks,
            )
            est = _setup_s(alt["layers"], full_layers) + TIME_MARGIN * pred["step_s"] * (
                alt["warmup"] + alt["steps"] + int(args.kernel_breakdown)
            )
            left = args.budget_s - (time.monotonic() - start)
            if est <= left:
                chosen = dict(alt, predicted=pred, estimate_s=est)
                break
            skipped.append(
                dict(
                    alt,
                    predicted=pred,
                    estimate_s=est,
                    status="skipped",
                    note=f"predicted {est:.0f} s > {left:.0f} s left",
                )
            )
        for s in skipped:
            report["probes"].append(s)
            print(f"skip {s['mode']} {s['seq_len']} x {s['layers']} layers: {s['note']}", flush=True)
        if chosen is None:
            continue
        spec = dict(
            chosen,
            shape=args.shape,
            lora_rank=args.lora_rank,
            host_budget=host_budget,
            disk_dir=args.disk_dir,
            breakdown=args.peak_breakdown,
            kernel_breakdown=args.kernel_breakdown,
            copy_launches=args.copy_launches,
            extra=extra,
        )
        full = full_depth(
            args.shape, chosen["mode"], chosen["seq_len"], chosen["layers"], args.lora_rank, host_budget, budgets
        )
        left = args.budget_s - (time.monotonic() - start)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=max(30.0, min(left, 2 * chosen["estimate_s"] + 60)),
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if lines:
                result = json.loads(lines[-1][7:])
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
                result = {"status": "error", "note": f"exit {proc.returncode}: {tail[0][:200]}"}
        except subprocess.TimeoutExpired:
            result = {"status": "timeout", "note": f"killed after {time.monotonic() - t0:.0f} s"}
        result["wall_s"] = time.monotonic() - t0
        row = dict(chosen, **result, full_depth_predicted=full)
        if row.get("peak_allocated_gib"):
            row["measured_over_predicted"] = row["peak_allocated_gib"] / chosen["predicted"]["peak_gib"]
        if row.get("step_s"):
            row["tokens_per_s"] = chosen["seq_len"] / row["step_s"]
            row["tflops"] = chosen["predicted"]["flops"] / row["step_s"] / 1e12
        report["probes"].append(row)
        print(_line(row), flush=True)
        _write(report, args.out, args.name)
    _write(report, args.out, args.name)
    print(open(os.path.join(args.out, args.name + ".md")).read())
    return 0


def _line(r: dict) -> str:
    head = f"{r['mode']:<10} {r['seq_len']:>7} x {r['layers']:>2}L {r['status']:<7}"
    if r.get("step_s"):
        return (
            head + f" step {r['step_s']:.2f} s (pred {r['predicted']['step_s']:.2f}) {r['tokens_per_s']:.0f} tok/s "
            f"{r['tflops']:.0f} TFLOP/s peak {r['peak_allocated_gib']:.2f} GiB (pred {r['predicted']['peak_gib']:.2f}, "
            f"x{r['measured_over_predicted']:.2f}) wall {r['wall_s']:.0f} s"
        )
    return head + f" {r.get('note', '')} wall {r.get('wall_s', 0):.0f} s"


def _fmt(x, spec=".2f") -> str:
    return "" if x is None else format(x, spec)


def _write(report: dict, out: str, name: str) -> None:
    report.setdefault("provenance", provenance())
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    lines = [
        f"{report['shape']}, LoRA r={report['lora_rank']}; {report.get('device')}, torch {report.get('torch')}",
        f"budgets: GPU {report['budgets']['gpu_gib']:.1f} GiB, host {report['budgets']['host_gib']:.1f} GiB, "
        f"disk {report['budgets']['disk_gib']:.1f} GiB; rates {report['budgets']['rates']}",
        f"planner, full depth: {report['capacity']}",
        "",
        "| mode | seq | layers | status | step s | pred step s | bound | tokens/s | TFLOP/s | peak alloc GiB | "
        "pred peak GiB | meas/pred | reserved GiB | host RSS GiB | disk GiB | full-depth host+disk GiB (pred) | "
        "loss | grad norm | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["probes"]:
        p, full = r["predicted"], r.get("full_depth_predicted") or {}
        footprint = f"{full['host_gib']:.1f}+{full['disk_gib']:.1f}" if full else ""
        lines.append(
            f"| {r['mode']} | {r['seq_len']} | {r['layers']} | {r['status']} | {_fmt(r.get('step_s'))} | "
            f"{p['step_s']:.2f} | {p['bound']} | {_fmt(r.get('tokens_per_s'), '.0f')} | "
            f"{_fmt(r.get('tflops'), '.0f')} | "
            f"{_fmt(r.get('peak_allocated_gib'))} | {p['peak_gib']:.2f} | {_fmt(r.get('measured_over_predicted'))} | "
            f"{_fmt(r.get('peak_reserved_gib'))} | {_fmt(r.get('host_rss_gib'))} | {_fmt(r.get('disk_written_gib'))} | "
            f"{footprint} | {_fmt(r.get('loss'), '.6f')} | {_fmt(r.get('grad_norm'), '.6g')} | "
            f"{r.get('note', '')[:80]} |"
        )
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
