"""FSDP2 with checkpointing and block-input offloading, one process per GPU (torchrun).

Llama shape (default Llama-3.2-1B), full fine-tune, bf16, SDPA, FSDP2 per decoder layer and
at the root, ``--seq-len`` tokens per rank. Modes: FSDP2 + Hugging Face checkpointing;
FSDP2 + offloadkit checkpointing; the same with block inputs offloaded. Each mode: 2
warm-up steps, then the median of ``--steps`` timed steps (forward, backward, grad-norm,
AdamW), synchronised around the timer. Per-rank peak GPU memory is gathered; losses and
grad norms are compared with the first mode.

    torchrun --nproc_per_node 2 benchmarks/fsdp2.py --out bench-results/fsdp2

Two more modes for full fine-tuning past one GPU: ``ckpt+input_offload+backward_adamw``
(the same, with BackwardAdamW updating each reduce-scattered shard in backward, its state in
pinned host memory, no gradients kept; ``+layer_groups`` after it fetches the state a decoder
layer ahead, as ``prepare()`` and the Trainer route set it) and ``cpu_offload_policy`` (FSDP2's own
``CPUOffloadPolicy``: parameters, gradients and the optimizer on the host, Hugging Face
checkpointing, torch AdamW on the CPU). All modes keep bf16 parameters. ``--chunked-loss N``
computes offloadkit modes' loss over N token chunks (the longest sequence a full fine-tune
reaches is bound by the logits otherwise). A mode that runs out of GPU memory is recorded as
such (``oom``); run a capacity ladder one mode and length per process.

    torchrun --nproc_per_node 4 benchmarks/fsdp2.py --shape llama-3-8b --seq-len 16384 \
        --modes hf_ckpt,ckpt+input_offload+backward_adamw --out bench-results/fsdp2-8b
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offloadkit.bench.provenance import provenance
from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.models.zoo import build_llama, make_batch


def build(shape: str, mode: str, chunked_loss: int = 0):
    model = build_llama(shape, dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa")
    model.train()
    handle = None
    kwargs = {}
    if mode in ("hf_ckpt", "cpu_offload_policy"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        handle = apply_activation_checkpointing(model, offload_inputs=mode.startswith("ckpt+input_offload"))
        if chunked_loss:
            from offloadkit.longctx import apply_chunked_loss

            apply_chunked_loss(model, chunked_loss)
    if mode == "cpu_offload_policy":
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if "+backward_adamw" in mode:
        from offloadkit.optim import BackwardAdamW

        # Each shard updated on FSDP2's post-reduce stream, its moments in pinned host memory.
        opt = BackwardAdamW(model.parameters(), lr=1e-5)
        if mode.endswith("+layer_groups"):
            # The state fetched a layer ahead, as prepare() and the Trainer route set it.
            opt.set_update_groups([list(layer.parameters()) for layer in model.model.layers])
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, handle, opt


def _one_step(model, opt, batch) -> None:
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run(mode: str, args, rank: int, world: int) -> dict:
    # The previous mode's model sits in reference cycles (hooks, FSDP2 state): collect it, or
    # its parameters would count in this mode's peak.
    gc.collect()
    torch.cuda.empty_cache()
    start_allocated = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model, handle, opt = build(args.shape, mode, args.chunked_loss)
    batch = make_batch(model.config.vocab_size, 1, args.seq_len, device="cuda", seed=rank)
    times, losses, norms = [], [], []
    torch.cuda.reset_peak_memory_stats()
    try:
        for i in range(2 + args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(**batch).loss
            loss.backward()
            # Updates in backward consume the gradients: a norm over the few left would
            # compare unlike with the reference (NaN).
            has_grads = "+backward_adamw" not in mode and any(p.grad is not None for p in model.parameters())
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9) if has_grads else None
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            norms.append(norm.full_tensor().item() if norm is not None else float("nan"))
    except torch.OutOfMemoryError as exc:
        print(f"OOM rank {rank} mode {mode} at {args.seq_len} tokens: {str(exc)[:160]}", flush=True)
        os._exit(3)  # the other ranks wait in a collective: a capacity ladder's stop
    kernels = None
    if args.kernel_breakdown:
        from benchmarks.kernel_time import profile_step

        # After the timed steps: the peaks above are theirs.
        kernels = profile_step(functools.partial(_one_step, model, opt, batch))
    peaks = torch.tensor(
        [torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30], device="cuda"
    )
    gathered = [torch.zeros_like(peaks) for _ in range(world)]
    dist.all_gather(gathered, peaks)
    row = dict(
        mode=mode,
        step_s=statistics.median(times),
        losses=losses,
        grad_norms=norms,
        allocated_before_build_gib=start_allocated / 2**30,
        tokens_per_s=world * args.seq_len / statistics.median(times),
        peak_allocated_gib=[g[0].item() for g in gathered],
        peak_reserved_gib=[g[1].item() for g in gathered],
    )
    if kernels is not None:
        row["kernels_rank0" if rank == 0 else "kernels"] = kernels
    if handle is not None and handle.offloader is not None:
        stats = handle.offloader.collect_stats()
        row.update(
            offloaded_gib_per_step=stats.offloaded_bytes / 2**30 / (2 + args.steps),
            prefetch_misses=stats.prefetch_misses,
            wait_s=stats.wait_seconds,
            host_gib=handle.offloader.host_bytes() / 2**30,
        )
    if handle is not None:
        handle.remove()
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", default="hf_ckpt,ckpt,ckpt+input_offload")
    ap.add_argument("--chunked-loss", type=int, default=0, help="offloadkit modes: loss over this many chunks")
    ap.add_argument(
        "--kernel-breakdown",
        action="store_true",
        help="one more step of each mode under the profiler: GPU time by kernel group, the compute stream's idle time",
    )
    ap.add_argument("--out", default="bench-results/fsdp2")
    args = ap.parse_args()
    dist.init_process_group("cpu:gloo,cuda:nccl")  # CPUOffloadPolicy reduces host-side tensors too
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rows = [run(mode, args, rank, world) for mode in args.modes.split(",")]
    if rank == 0:
        base = rows[0]
        lines = [
            "| mode | step s | vs first | tokens/s | peak alloc GiB (per rank) | vs first GiB | offloaded GiB/step "
            "| allocated before build GiB | loss equal | grad-norm rel diff |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            rel = max(abs(a - b) / abs(b) for a, b in zip(r["grad_norms"], base["grad_norms"]))  # NaN: no gradients
            r["loss_equal_to_first"] = r["losses"] == base["losses"]
            r["grad_norm_max_rel_diff"] = rel
            lines.append(
                f"| {r['mode']} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.3f}x | "
                f"{r['tokens_per_s']:.0f} | {', '.join(f'{p:.2f}' for p in r['peak_allocated_gib'])} | "
                f"{r['peak_allocated_gib'][0] - base['peak_allocated_gib'][0]:+.2f} | "
                f"{r.get('offloaded_gib_per_step', 0):.2f} | {r['allocated_before_build_gib']:.2f} | "
                f"{r['loss_equal_to_first']} | {rel:.2e} |"
            )
        head = (
            f"{args.shape}, {args.seq_len} tokens per rank, {world} x {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}" + (f", chunked loss {args.chunked_loss}" if args.chunked_loss else "")
        )
        os.makedirs(args.out, exist_ok=True)
        # Plain characters only, so the name is safe in any shell or archive.
        modes = "__".join(r["mode"].replace("+", "-") for r in rows)
        stem = f"fsdp2-{args.shape}-{world}x{args.seq_len}-{modes}"
        with open(os.path.join(args.out, stem + ".json"), "w") as f:
            json.dump(dict(setup=head, rows=rows, provenance=provenance()), f, indent=1)
        with open(os.path.join(args.out, stem + ".md"), "w") as f:
            f.write(f"# FSDP2\n\n{head}\n\n" + "\n".join(lines) + "\n")
        print(head)
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
