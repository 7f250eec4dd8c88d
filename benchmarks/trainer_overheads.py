"""Where the Trainer route costs more than a plain loop, measured on one GPU.

Two questions, each case in a process of its own:

* ``reentrant``: the Trainer with Hugging Face's checkpointing (reentrant and non-reentrant),
  without and with offloadkit's mixin (checkpoint inputs offloaded), interleaved in rounds so
  that drift between runs lands on both sides; the median step of each run and the ratio per
  round.
* ``fullft-*``: a full fine-tune with BackwardAdamW's state in host memory and the checkpoint
  inputs offloaded, as a plain loop with the components built by hand (``fullft-plain``), as a
  plain loop through ``prepare()`` sharing its scheduler (``fullft-prepare``), and through
  ``offloadkit train`` (``fullft-train``): the GPU's waits for activation copies, prefetch hits
  and misses, step time, peaks, and the reserved bytes by the stream that owns them.

    python benchmarks/trainer_overheads.py --out DIR [--cases reentrant,fullft-plain,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_GiB = 1 << 30
CASES = ("reentrant", "fullft-plain", "fullft-prepare", "fullft-train")


def reserved_by_stream() -> dict:
    """GiB reserved and allocated in each stream's segments (the compute stream is 0)."""
    out: dict = {}
    for seg in torch.cuda.memory_snapshot():
        row = out.setdefault(str(seg["stream"]), {"reserved_gib": 0.0, "allocated_gib": 0.0, "segments": 0})
        row["reserved_gib"] += seg["total_size"] / _GiB
        row["allocated_gib"] += seg["allocated_size"] / _GiB
        row["segments"] += 1
    return out


def _memory() -> dict:
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / _GiB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / _GiB,
        "by_stream": reserved_by_stream(),
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }


def _fullft(case: str, args) -> dict:
    from offloadkit.checkpointing import apply_activation_checkpointing
    from offloadkit.compose import prepare
    from offloadkit.longctx import apply_chunked_loss
    from offloadkit.models.zoo import LLAMA_SHAPES, build_llama, make_batch
    from offloadkit.optim import BackwardAdamW

    model = build_llama(args.shape, dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    if case == "fullft-plain":
        ckpt = apply_activation_checkpointing(model, offload_inputs=True)
        apply_chunked_loss(model)
        opt = BackwardAdamW.for_precision(model.parameters(), args.precision, lr=1e-5, weight_decay=0.0)
        stats_of = ckpt.offloader
        context = None
    else:
        runtime = prepare(
            model, {"gradient_checkpointing": True, "activation_offloading": True, "chunked_cross_entropy": True}
        )
        opt = BackwardAdamW.for_precision(
            model.parameters(), args.precision, lr=1e-5, weight_decay=0.0, scheduler=runtime.scheduler
        )
        stats_of = runtime.manager
        context = runtime.context
    batch = make_batch(LLAMA_SHAPES[args.shape]["vocab_size"], 1, args.seq_len, device="cuda", seed=0)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            stats_of.reset_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if context is None:
            loss = model(**batch).loss
        else:
            with context():
                loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    stats = stats_of.collect_stats().as_dict()
    return {
        "case": case,
        "step_s": statistics.median(times),
        "steps_s": times,
        "wait_s_per_step": {k: stats[k] / args.steps for k in ("wait_seconds_forward", "wait_seconds_backward")},
        "prefetch_hits": stats.get("prefetch_hits"),
        "prefetch_misses": stats.get("prefetch_misses"),
        **_memory(),
    }


def _fullft_train(args) -> dict:
    folder = tempfile.mkdtemp()
    cfg = os.path.join(folder, "cfg.yaml")
    with open(cfg, "w") as f:
        f.write(
            f"model_shape: {args.shape}\nseq_len: {args.seq_len}\nbatch_size: 1\nlora_rank: 0\ndtype: bfloat16\n"
            f"max_steps: {args.warmup + args.steps}\nlearning_rate: 1.0e-5\nlr_scheduler: constant\n"
            "warmup_steps: 0\nmax_grad_norm: 0\nlogging_steps: 1\ncompare: false\ngradient_checkpointing: true\n"
            "activation_offloading: true\noptimizer_offloading: true\nchunked_cross_entropy: true\n"
            f"optimizer_precision: {args.precision}\noutput_dir: {folder}/run\n"
        )
    proc = subprocess.run([sys.executable, "-m", "offloadkit", "train", cfg], capture_output=True, text=True)
    record: dict = {"case": "fullft-train", "rc": proc.returncode}
    try:
        with open(os.path.join(folder, "run", "report.json")) as f:
            record["report"] = json.load(f)
    except OSError:
        record["stderr_tail"] = proc.stderr[-2000:]
    return record


def _reentrant(args) -> dict:
    from benchmarks.compat_trainers import MODES, _clean, _loop_run

    mixin = MODES["checkpoint-input offload"][0]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for reentrant in (False, True):
            for r in range(args.rounds):
                order = [("plain", None), ("mixin", mixin)]
                if r % 2:
                    order.reverse()  # the second of a pair runs warmer: alternate who goes second
                got = {}
                for name, cfg in order:
                    res = _loop_run(
                        folder, f"{name}-{reentrant}-{r}", args.loop_seq_len, mixin=cfg, reentrant=reentrant
                    )
                    got[name] = {"step_s": res["step_s"], "steps_s": res["steps_s"]}
                    acts = (res.get("report") or {}).get("activations") or {}
                    if acts:
                        got[name]["activations"] = {
                            k: acts.get(k)
                            for k in ("prefetch_hits", "prefetch_misses", "wait_seconds", "offloaded_tensors")
                        }
                    _clean()
                rows.append(
                    {
                        "reentrant": reentrant,
                        "round": r,
                        "ratio": got["mixin"]["step_s"] / got["plain"]["step_s"],
                        **got,
                    }
                )
                print(json.dumps({k: rows[-1][k] for k in ("reentrant", "round", "ratio")}), flush=True)
    return {"case": "reentrant", "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--shape", default="llama-3.2-3b")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--precision", default="params")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loop-seq-len", type=int, default=2048)
    ap.add_argument("--tag", default="")
    ap.add_argument("--one", default=None)
    args = ap.parse_args()
    if args.one:
        if args.one == "reentrant":
            record = _reentrant(args)
        elif args.one == "fullft-train":
            record = _fullft_train(args)
        else:
            record = _fullft(args.one, args)
        print("RECORD " + json.dumps(record), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"trainer-overheads{args.tag}.json")
    records = []
    for case in args.cases.split(","):
        cmd = [sys.executable, __file__, "--out", args.out, "--one", case]
        for flag in ("shape", "seq_len", "precision", "steps", "warmup", "rounds", "loop_seq_len"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RECORD ")]
        record = json.loads(lines[-1][7:]) if lines else {"case": case, "error": proc.stderr[-3000:]}
        record["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        records.append(record)
        print(json.dumps(record)[:1500], flush=True)
        with open(path, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records}, f, indent=1
            )


if __name__ == "__main__":
    main()
