"""Frozen weights off the GPU, two ways, side by side: offloadkit's layer streaming against
FSDP2's ``CPUOffloadPolicy``, on one GPU (torchrun, one rank).

Llama shape (default Llama-3-8B), LoRA r=16 on every linear layer, bf16, SDPA, one sequence
of ``--seq-len`` tokens; offloadkit checkpointing with block inputs offloaded in every mode.
Modes:

* ``resident``: the weights stay on the GPU (the reference);
* ``layer_streaming``: ``layer_offloading: true``, the frozen decoder-layer weights stream
  from pinned RAM one layer ahead (embeddings, head and adapters stay resident);
* ``fsdp2_cpu_offload``: ``fully_shard`` per decoder layer and at the root with
  ``CPUOffloadPolicy()``; every parameter lives in pinned RAM and is copied in per layer,
  gradients go back to the CPU and AdamW steps there.

Each mode: ``--warmup`` steps, then the median of ``--steps`` timed steps (forward, backward,
AdamW), synchronised around the timer; peak GPU memory allocated and reserved, host RSS.

    torchrun --nproc_per_node 1 benchmarks/weights_offload.py --out bench-results/weights
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import psutil
import torch
import torch.distributed as dist

GiB = float(1 << 30)


def build(args, mode: str):
    from offloadkit.compose import prepare
    from offloadkit.integrations.peft_utils import apply_lora
    from offloadkit.models.zoo import build_llama

    model = build_llama(
        args.shape,
        dtype=torch.bfloat16,
        device="cuda",
        attn_implementation="sdpa",
        num_hidden_layers=args.layers,
        max_position_embeddings=max(args.seq_len, 8192),
    )
    model.config.use_cache = False
    # bf16 adapters too: FSDP2 gathers a layer's parameters as one buffer of one dtype.
    model = apply_lora(model, rank=args.lora_rank).to(torch.bfloat16)
    model.train()
    config = {
        "gradient_checkpointing": True,
        "activation_offloading": True,
        "layer_offloading": mode == "layer_streaming",
    }
    runtime = prepare(model, config)
    if mode == "fsdp2_cpu_offload":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        for layer in model.base_model.model.model.layers:
            fully_shard(layer, offload_policy=CPUOffloadPolicy())
        fully_shard(model, offload_policy=CPUOffloadPolicy())
    return model, runtime


def run(mode: str, args) -> dict:
    gc.collect()  # the previous mode's model sits in reference cycles (hooks, FSDP2 state)
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, runtime = build(args, mode)
    setup_s = time.perf_counter() - t0
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    from offloadkit.models.zoo import make_batch

    batch = make_batch(model.config.vocab_size, 1, args.seq_len, device="cuda")
    proc = psutil.Process()
    times, losses, rss = [], [], 0
    torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with runtime.context():
            loss = model(**batch).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        rss = max(rss, proc.memory_info().rss)
    step_s = statistics.median(times)
    row = dict(
        mode=mode,
        step_s=step_s,
        tokens_per_s=args.seq_len / step_s,
        losses=losses,
        setup_s=setup_s,
        peak_allocated_gib=torch.cuda.max_memory_allocated() / GiB,
        peak_reserved_gib=torch.cuda.max_memory_reserved() / GiB,
        host_rss_gib=rss / GiB,
    )
    steps = args.warmup + args.steps
    if runtime.streamer is not None:
        row["streamed_weights_gib"] = runtime.streamer.streamed_bytes / GiB  # held in RAM, off the GPU
        row["weights_copied_in_gib_per_step"] = runtime.streamer.collect_stats().loaded_bytes / GiB / steps
    report = runtime.report()
    row["offloaded_activations_gib_per_step"] = (
        report["activations"]["offloaded_bytes"] / GiB / steps if report.get("activations") else 0.0
    )
    runtime.close()
    del model, opt, runtime
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default="resident,layer_streaming,fsdp2_cpu_offload")
    ap.add_argument("--out", default="bench-results/weights")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rows = []
    for mode in args.modes.split(","):
        try:
            rows.append(run(mode, args))
        except Exception as exc:  # noqa: BLE001 - one mode failing must not hide the others
            rows.append(dict(mode=mode, error=repr(exc)[:500]))
        print(json.dumps(rows[-1]), flush=True)
    head = (
        f"{args.shape} ({args.layers} layers), LoRA r={args.lora_rank}, {args.seq_len} tokens, "
        f"1 x {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    base = rows[0] if "error" not in rows[0] else None
    lines = [
        "| mode | step s | vs resident | tokens/s | peak alloc GiB | peak reserved GiB | host RSS GiB "
        "| streamed weights GiB | copied in GiB/step | first loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | failed: {r['error'][:120]} | | | | | | | | |")
            continue
        ratio = f"{r['step_s'] / base['step_s']:.3f}x" if base else ""
        lines.append(
            f"| {r['mode']} | {r['step_s']:.3f} | {ratio} | {r['tokens_per_s']:.0f} | "
            f"{r['peak_allocated_gib']:.2f} | {r['peak_reserved_gib']:.2f} | {r['host_rss_gib']:.1f} | "
            f"{r.get('streamed_weights_gib', 0):.2f} | {r.get('weights_copied_in_gib_per_step', 0):.2f} | "
            f"{r['losses'][0]:.6f} |"
        )
    from offloadkit.bench.provenance import provenance

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "weights-offload.json"), "w") as f:
        json.dump(dict(setup=head, rows=rows, provenance=provenance()), f, indent=1)
    with open(os.path.join(args.out, "weights-offload.md"), "w") as f:
        f.write(
            f"# Frozen weights off the GPU: layer streaming vs FSDP2 CPUOffloadPolicy\n\n{head}\n\n"
            + "\n".join(lines)
            + "\n"
        )
    print(head)
    print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
