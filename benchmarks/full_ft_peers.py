"""Full fine-tuning with fp32 master weights on one GPU, side by side: offloadkit
(BackwardAdamW with fp32 master weights and moments in host memory, checkpointing with the
block inputs offloaded), FSDP2 with ``CPUOffloadPolicy`` on one rank, and DeepSpeed
ZeRO-Offload (stage 2: optimizer on the CPU; stage 3: parameters too), both with checkpointing.

Every mode trains the same Llama-shaped model (random init, the same fp32 weights cast to
bf16 for compute), on the same random tokens, one sequence of ``--seq-len`` a step, AdamW
without weight decay, SDPA attention. Each mode runs in a process of its own: 2 warm-up steps,
then the median of ``--steps`` synchronised steps (forward, backward, optimizer step).
Recorded: step time, tokens/s, peak GPU memory (allocated and reserved), the process's peak
resident host memory, the losses. A peer whose host state cannot fit this machine's RAM is
not started (a host out of memory takes the machine down with it): its record says what it
would need.

    python benchmarks/full_ft_peers.py --out DIR --shapes llama-3.2-3b,llama-3-8b

``+liger`` after an offloadkit mode runs the norms and the gated MLPs through Liger's kernels
(liger-kernel installed); ``+selective`` saves each block's matmul and attention outputs
(``selective_checkpointing: [mm, attention]``) so its recompute runs only the pointwise ops,
where the GPU has room for them. ``--kernel-breakdown`` profiles one more step of each mode
(``benchmarks/kernel_time.py``).

Mode ``offloadkit_plan`` is the GPU side of the planner's longest full fine-tune instead:
the plan for ``--budgets`` (GPU, host, disk GiB; the GPU's enforced through
``gpu_budget_bytes``) at ``--seq-len`` (0: the planner's longest), applied with ``prepare()``
to a model of ``--layers`` decoder layers (the GPU peak does not grow with depth), with
BackwardAdamW at ``--precision`` and, where liger-kernel runs, Liger's kernels (as
``offload_plan: auto`` turns them on); the record has the plan's predicted step for this depth and
for the full one.

    python benchmarks/full_ft_peers.py --out DIR --shapes llama-3-8b --modes offloadkit_plan \
        --seq-len 0 --layers 2 --budgets 79,108,55 --warmup 1 --steps 1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offloadkit.models.zoo import LLAMA_SHAPES, build_llama, make_batch  # noqa: E402
from offloadkit.planning.shape import ModelShape  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_trace  # noqa: E402

MODES = (
    "offloadkit",
    "offloadkit+chunked_loss",
    "fsdp2_cpu_offload",
    "deepspeed_zero2_offload",
    "deepspeed_zero3_offload",
)
LR = 1e-5
_GiB = 1 << 30
# Host bytes per parameter each mode keeps (fp32 master weights and moments; the peers also
# hold fp32 gradients on the host), for the check before starting.
HOST_BYTES_PER_PARAM = {"offloadkit": 12, "fsdp2": 16, "deepspeed": 16}


def _available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def _model_fp32(shape: str, device: str):
    model = build_llama(shape, dtype=torch.float32, device=device, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def _state_allocation(how: str) -> None:
    """Diagnostic rearrangements of where BackwardAdamW's state buffers come from (not options
    of the library): "per_tensor" (each from the allocator, no arena), "flat" (one buffer a
    parameter, its keys as views), "pool" (a private memory pool on the compute stream),
    "flat+pool"; "arena_half" (the arena at half what the last pass held at once: copies in
    wait on the device for copies back sooner); "as_is" leaves the library's (one arena a pass)."""
    if how == "as_is":
        return
    if how == "arena_half":
        from offloadkit.optim.state_arena import RingSize

        measured = RingSize.end_pass
        RingSize.end_pass = lambda self: measured(self) // 2
        return
    from offloadkit.optim.state_copies import StateCopies

    pools: dict = {}

    def allocate(self, state, keys, device):
        pool = pools.setdefault(device, torch.cuda.MemPool()) if "pool" in how else None
        with torch.cuda.use_mem_pool(pool, device) if pool is not None else contextlib.nullcontext():
            if "flat" not in how:
                return {k: torch.empty(state[k].shape, dtype=state[k].dtype, device=device) for k in keys}, None, []
            sizes = [(state[k].nbytes + 511) // 512 * 512 for k in keys]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        out, at = {}, 0
        for k, n in zip(keys, sizes):
            out[k] = flat[at : at + state[k].nbytes].view(state[k].dtype).view(state[k].shape)
            at += n
        return out, None, []

    StateCopies._allocate = allocate


def _build_offloadkit(shape: str, chunked: bool, args, liger: bool = False, selective: bool = False):
    from offloadkit import use_expandable_segments
    from offloadkit.checkpointing import apply_activation_checkpointing
    from offloadkit.longctx import apply_chunked_loss
    from offloadkit.optim import BackwardAdamW

    # What prepare() does for a run it builds: components built by hand leave the allocator
    # alone, so this route asks for segments that grow in place itself.
    _state_allocation(args.state_allocation)
    model = _model_fp32(shape, "cuda").to(torch.bfloat16)  # the peers' weights, rounded as their bf16 compute
    # After the model, as prepare() is called: switching on also gives back the fp32 copies'
    # memory the cast left cached (use_expandable_segments).
    use_expandable_segments()
    model.train()
    if liger:
        from offloadkit.kernels import apply_liger_kernels

        # Before checkpointing, as prepare() orders them: the norms and gating run fused.
        apply_liger_kernels(model)
    handles = [
        apply_activation_checkpointing(model, offload_inputs=True, selective=("mm", "attention") if selective else None)
    ]
    if chunked:
        handles.append(apply_chunked_loss(model))
    precision = args.precision if args.ours_params else "fp32_master"
    opt = BackwardAdamW.for_precision(
        model.parameters(),
        precision,
        lr=LR,
        weight_decay=0.0,
        copy_window_bytes=None if args.copy_window_mib is None else args.copy_window_mib << 20,
    )
    offloader = handles[0].offloader

    def step(batch):
        loss = model(**batch).loss
        loss.backward()  # each parameter updated here, its state streamed in and out
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def waits() -> dict:
        """The waits since the last call (the engine's counters start again)."""
        stats = offloader.collect_stats()
        out = {"activation_wait_s": stats.wait_seconds, "activation_host_wait_s": stats.host_wait_seconds}
        offloader.reset_stats()
        return out

    window = opt._copies.window_bytes >> 20
    if args.update_groups:
        opt.set_update_groups([list(layer.parameters()) for layer in model.model.layers])
    how = f", state {args.state_allocation}" if args.state_allocation != "as_is" else ""
    how += ", by layers" if args.update_groups else ""
    how += ", empty_cache each step" if args.empty_cache_each_step else ""
    info = {"optimizer": f"BackwardAdamW({precision}, window {window} MiB{how})", "waits": waits}
    return step, info


def _build_fsdp2(shape: str):
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    dist.init_process_group("cpu:gloo,cuda:nccl")
    model = _model_fp32(shape, "cuda").cpu()  # fp32 master weights: the parameters themselves, on the host
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    info = {}
    try:  # PyTorch's fastest CPU AdamW; the for-loop one where the fused kernel is refused
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
        info["optimizer"] = "torch.optim.AdamW(fused=True) on the CPU"
    except (RuntimeError, ValueError) as exc:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        info["optimizer"] = f"torch.optim.AdamW on the CPU (fused refused: {str(exc)[:120]})"

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, info


def _build_deepspeed(shape: str, stage: int):
    import deepspeed

    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": 0.0,
    }
    model = _model_fp32(shape, "cuda").cpu()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.train()

    def step(batch):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return loss

    return step, {"optimizer": type(opt.optimizer if hasattr(opt, "optimizer") else opt).__name__}


def _build_planned(shape: str, args) -> tuple:
    from offloadkit.checkpointing.footprint import keeps_attention
    from offloadkit.checkpointing.options import CheckpointOptions
    from offloadkit.component import OptionSet
    from offloadkit.compose import prepare
    from offloadkit.kernels.liger import liger_unusable
    from offloadkit.kernels.options import KernelOptions
    from offloadkit.optim import BackwardAdamW
    from offloadkit.planning import (
        Budgets,
        OptimizerSetup,
        Workload,
        estimate_memory,
        estimate_time,
        longest_sequence,
        plan,
    )
    from offloadkit.planning.memory import region_length
    from offloadkit.planning.plan import input_counts, place_inputs, with_options
    from offloadkit.planning.shape import resolve_shape

    gpu, host, disk = (int(float(x) * _GiB) for x in args.budgets.split(","))
    budgets = Budgets(gpu, host, disk)
    # This loop steps BackwardAdamW without clipping: every parameter is updated in backward.
    optimizer = OptimizerSetup(updates_in_backward=True, source="BackwardAdamW without clipping")
    # Liger's kernels where they run, as offload_plan: auto turns them on.
    kernels = (KernelOptions(rms_norm=True, glu_activation=True),) if liger_unusable() is None else ()
    seq = args.seq_len
    if not seq:
        seq = longest_sequence(shape, lora_rank=0, budgets=budgets, optimizer=optimizer, options=kernels).longest
    precision = args.precision
    full = plan(
        shape, seq, lora_rank=0, budgets=budgets, optimizer_precision=precision, optimizer=optimizer, options=kernels
    )
    # The GPU side at reduced depth holds what the full plan holds at its peak: the last
    # block's input on the GPU and the longest run of blocks one kept input replays.
    replayed = region_length(full.placement)
    layers = max(args.layers, replayed + 1) if replayed > 1 else args.layers
    w = Workload(resolve_shape(shape, layers), seq, 1, 0, optimizer_precision=precision, updates_in_backward=True)
    # Every stored input in RAM, the full plan's held on the GPU, its longest run replayed; as
    # many layers' attention outputs kept as the full plan keeps.
    f = place_inputs(w, full.options, input_counts(full.workload, full.options)[0], replayed - 1)
    kept = keeps_attention(full.workload, OptionSet(full.options))
    f = with_options(f, CheckpointOptions, keep_attention=kept or False)
    memory = estimate_memory(w, f)
    predicted = estimate_time(w, f, budgets.rates, memory.block_placement)
    config = dict(full.to_config(), gpu_budget_bytes=gpu, disk_dir=args.disk_dir)
    if kernels:
        config.update(liger_rms_norm=True, liger_glu_activation=True)
    config["block_input_placement"] = tuple(memory.block_placement)
    model = build_llama(
        shape, dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa", num_hidden_layers=layers
    )
    model.config.use_cache = False
    model.train()
    runtime = prepare(model, config)
    opt = BackwardAdamW.for_precision(model.parameters(), precision, lr=LR, weight_decay=0.0)

    def step(batch):
        with runtime.context():
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    info = {
        "seq_len": seq,
        "layers": layers,
        "precision": precision,
        "placement_full_depth": list(full.placement),
        "budgets_gib": args.budgets,
        "config": {k: v for k, v in config.items() if v is not None},
        "fits": full.fits,
        "predicted_step_s": predicted.seconds,
        "predicted_full_depth_step_s": full.time.seconds,
        "predicted_gpu_gib": memory.gpu_reserved / _GiB,
        "predicted_full_depth_gpu_gib": full.memory.gpu_reserved / _GiB,
        "optimizer": f"BackwardAdamW({precision})",
    }
    return step, info, seq


def run_one(mode: str, shape: str, args) -> dict:
    params = ModelShape.from_config(LLAMA_SHAPES[shape], name=shape).params
    family = mode.split("_")[0].split("+")[0]
    if mode == "offloadkit_plan":
        params = ModelShape.from_config(dict(LLAMA_SHAPES[shape], num_hidden_layers=args.layers)).params
    need = params * HOST_BYTES_PER_PARAM[family]
    record = {"mode": mode, "shape": shape, "seq_len": args.seq_len, "params": params, "host_state_gib": need / _GiB}
    available = _available_host_bytes()
    if need + 8 * _GiB > available:
        record["skipped"] = (
            f"its host state needs {need / _GiB:.0f} GiB ({HOST_BYTES_PER_PARAM[family]} bytes a parameter) and the "
            f"runtime about 8 more; this machine has {available / _GiB:.0f} GiB available"
        )
        return record
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29521")
    torch.cuda.set_device(0)
    seq_len = args.seq_len
    if mode == "offloadkit_plan":
        step, info, seq_len = _build_planned(shape, args)
    elif mode.startswith("offloadkit"):
        step, info = _build_offloadkit(
            shape, chunked="+chunked_loss" in mode, args=args, liger="+liger" in mode, selective="+selective" in mode
        )
    elif mode == "fsdp2_cpu_offload":
        step, info = _build_fsdp2(shape)
    else:
        step, info = _build_deepspeed(shape, 2 if "zero2" in mode else 3)
    waits = info.pop("waits", None)
    record.update(info)
    gc.collect()
    vocab = LLAMA_SHAPES[shape]["vocab_size"]
    batch = make_batch(vocab, 1, seq_len, device="cuda", seed=0)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    if waits is not None:
        waits()  # from here on: the timed steps' waits
    traced = None
    for i in range(args.warmup + args.steps):
        if i == 0 and args.memory_trace:
            traced = memory_trace.start()  # every step's allocations (the steps' times then include the recording)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(batch)
        if args.empty_cache_each_step:
            torch.cuda.empty_cache()  # timed: the step's free pages unmapped, remapped by the next
        torch.cuda.synchronize()
        losses.append(loss.item())
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        elif waits is not None:
            waits()  # warm-up steps' waits are not counted
    if traced is not None:
        record["memory_trace"] = memory_trace.summarize(memory_trace.stop(), traced)
    step_s = statistics.median(times)
    record.update(
        step_s=step_s,
        steps_s=times,
        tokens_per_s=seq_len / step_s,
        losses=losses,
        peak_allocated_gib=torch.cuda.max_memory_allocated() / _GiB,
        peak_reserved_gib=torch.cuda.max_memory_reserved() / _GiB,
        host_peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GiB,
    )
    if waits is not None:
        record.update({k: v / args.steps for k, v in waits().items()})  # per timed step
    if args.kernel_breakdown:
        from kernel_time import profile_step

        # One more step, profiled: not among the timed ones.
        record["kernel_breakdown"] = profile_step(lambda: step(batch))
    return record


def _table(records: list[dict], head: str) -> str:
    lines = [
        head,
        "",
        "| shape | mode | tokens | step s | tokens/s | vs offloadkit | GPU peak alloc / reserved GiB | "
        "host peak RSS GiB | first loss | optimizer / note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ours = {r["shape"]: r for r in records if r["mode"] == "offloadkit" and "step_s" in r}
    for r in records:
        if "step_s" not in r:
            why = r.get("skipped") or r.get("error", "no record")
            lines.append(
                f"| {r['shape']} | {r['mode']} | {r.get('seq_len', '-')} | - | - | - | - | - | - | not run: {why} |"
            )
            continue
        base = ours.get(r["shape"])
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base and r["mode"] != "offloadkit_plan" else "-"
        note = r.get("optimizer", "")
        if r["mode"] == "offloadkit_plan":
            note += (
                f"; {r['layers']} layers, plan for {r['budgets_gib']} GiB: "
                f"predicted {r['predicted_step_s']:.1f} s here, "
                f"{r['predicted_full_depth_step_s']:.0f} s at full depth, GPU {r['predicted_gpu_gib']:.1f} GiB"
            )
        lines.append(
            f"| {r['shape']} | {r['mode']} | {r['seq_len']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {ratio} | "
            f"{r['peak_allocated_gib']:.1f} / {r['peak_reserved_gib']:.1f} | {r['host_peak_rss_gib']:.1f} | "
            f"{r['losses'][0]:.4f} | {note} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="llama-3.2-3b,llama-3-8b")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2, help="offloadkit_plan: decoder layers built")
    ap.add_argument("--budgets", default="79,108,55", help="offloadkit_plan: GPU,host,disk GiB planned for")
    ap.add_argument(
        "--precision",
        default="params",
        help="optimizer_precision of offloadkit_plan, and of the offloadkit modes with --ours-params "
        "(they default to fp32_master, as the peers)",
    )
    ap.add_argument("--ours-params", action="store_true", help="offloadkit modes: use --precision as given")
    ap.add_argument(
        "--copy-window-mib", type=int, default=None, help="offloadkit modes: BackwardAdamW's window (default: its own)"
    )
    ap.add_argument(
        "--memory-trace",
        action="store_true",
        help="record the allocator's history over the timed steps; the record says what was live at the peaks",
    )
    ap.add_argument(
        "--state-allocation",
        default="as_is",
        choices=("as_is", "per_tensor", "arena_half", "flat", "pool", "flat+pool"),
        help="offloadkit modes: where the state buffers come from (a diagnostic rearrangement)",
    )
    ap.add_argument(
        "--empty-cache-each-step",
        action="store_true",
        help="diagnostic: give the allocator's free pages back after every step (the time counts it)",
    )
    ap.add_argument(
        "--update-groups", action="store_true", help="offloadkit modes: state looked ahead by decoder layers"
    )
    ap.add_argument("--disk-dir", default=None, help="offloadkit_plan: where the disk tier writes")
    ap.add_argument("--kernel-breakdown", action="store_true", help="profile one more step of each mode")
    ap.add_argument("--one", nargs=2, metavar=("MODE", "SHAPE"), help="run one case in this process")
    args = ap.parse_args()
    if args.one:
        mode, shape = args.one
        try:
            record = run_one(mode, shape, args)
        except Exception as exc:  # noqa: BLE001 - the error is the result
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            record = {"mode": mode, "shape": shape, "error": " ".join(last.split())[:400]}
            traceback.print_exc()
        print("RECORD " + json.dumps(record), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    records = []
    for shape in args.shapes.split(","):
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, "--out", args.out, "--seq-len", str(args.seq_len)]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--layers", str(args.layers)]
            cmd += ["--budgets", args.budgets, "--precision", args.precision, "--one", mode, shape]
            cmd += ["--copy-window-mib", str(args.copy_window_mib)] if args.copy_window_mib else []
            cmd += ["--ours-params"] if args.ours_params else []
            cmd += ["--memory-trace"] if args.memory_trace else []
            cmd += ["--state-allocation", args.state_allocation]
            cmd += ["--update-groups"] if args.update_groups else []
            cmd += ["--empty-cache-each-step"] if args.empty_cache_each_step else []
            cmd += ["--kernel-breakdown"] if args.kernel_breakdown else []
            if args.disk_dir:
                cmd += ["--disk-dir", args.disk_dir]
            log = os.path.join(args.out, f"{shape}-{mode}.log")
            with open(log, "w") as f:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RECORD ")]
            record = (
                json.loads(lines[-1][7:]) if lines else {"mode": mode, "shape": shape, "error": f"rc={proc.returncode}"}
            )
            records.append(record)
            print(json.dumps({k: v for k, v in record.items() if k not in ("steps_s", "losses")}), flush=True)
            with open(os.path.join(args.out, "full-ft-peers.json"), "w") as f:
                json.dump(records, f, indent=1)
    head = (
        f"# Full fine-tune, one GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{args.seq_len or 'the planned'} tokens a step, median of {args.steps} steps after {args.warmup} warm-ups; "
        f"fp32 master weights in the peers' and offloadkit's modes, optimizer_precision {args.precision} in "
        f"offloadkit_plan{' and the offloadkit modes' if args.ours_params else ''}\n\n"
        f"Command: `python {' '.join(sys.argv)}`."
    )
    text = _table(records, head)
    with open(os.path.join(args.out, "full-ft-peers.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
