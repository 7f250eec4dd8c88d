"""Context-parallel capacity and scaling: one sequence split over the ranks of ``torchrun``,
with everything offloadkit does to a long-context step on each rank (checkpointing,
block inputs offloaded to pinned RAM and disk, frozen-layer streaming, chunked loss,
tiled MLP and projections, as the planner chooses for the tokens each GPU holds).

Each rank holds ``--tokens-per-gpu`` tokens of a ``world x tokens-per-gpu`` sequence; run it
with 1, 2, 4 ... processes at a fixed ``--tokens-per-gpu`` for the scaling, and at reduced
depth (``--layers``) where a full-depth step outlasts a run: with block inputs offloaded and
weights streamed, what a GPU holds does not depend on depth. One warm-up step (optional),
then timed steps (forward, backward, gradient sum over the group, AdamW on the adapters).

    torchrun --nproc_per_node 2 benchmarks/context_parallel.py --shape llama-3-8b --lora-rank 16 \\
        --tokens-per-gpu 524288 --layers 2 --out bench-results/cp      # 1M tokens on 2 GPUs

With fewer GPUs than processes (a check on one GPU), the ranks share it over gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import yaml

GiB = float(1 << 30)


def model_flops(shape, lora_rank: int, seq: int, layers: int, world: int) -> float:
    """One GPU's share of a step's model FLOPs: linear layers forward and backward (no weight
    gradients for a frozen base; the recompute not counted), the LM head, and causal attention
    over the whole sequence (half the square, forward once, backward twice) split evenly."""
    from offloadkit.planning.rates import layer_linear_flops

    tokens = seq // world
    linear = layer_linear_flops(shape, lora_rank, tokens) * layers
    head = 2 * shape.vocab * shape.hidden * tokens * (2 if lora_rank else 3)
    attention = 3 * 2.0 * seq**2 * shape.heads * shape.head_dim * layers / world
    return float(linear + head + attention)


def timed_steps(
    step, warmup: int, steps: int, recorded: dict | None = None
) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """``warmup`` steps, then ``steps`` timed ones (each rank starts together, the GPU
    synchronised around the timer): their seconds, their losses and every rank's peak
    allocated and reserved GiB since the warm-up. ``recorded``, given: one more step with the
    allocator's history recorded, untimed, and what was alive at its peak, grouped by the line
    that allocated it, in ``recorded["peak_breakdown"]``."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if recorded is not None:
        from explain_peak import recorded_step

        dist.barrier()
        _, recorded["peak_breakdown"] = recorded_step(step)
    peaks = torch.tensor(
        [torch.cuda.max_memory_allocated() / GiB, torch.cuda.max_memory_reserved() / GiB],
        dtype=torch.float64,
        device="cuda",
    )
    gathered = [torch.zeros_like(peaks) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, peaks)
    return times, losses, gathered


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument(
        "--tokens-per-gpu", type=int, default=524288, help="0: the planner's longest sequence for these budgets"
    )
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--out", default="bench-results/cp")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key of the planned config (YAML value), e.g. keep_attention_outputs=false",
    )
    ap.add_argument(
        "--rotation",
        choices=("allgather", "alltoall"),
        default=None,
        help="how ring attention moves keys and values (default: the plan's, all-gather where it fits; "
        "all-to-all for ranks sharing one GPU)",
    )
    ap.add_argument(
        "--gpu-gib",
        type=float,
        default=None,
        help="plan for this much GPU memory and cap the process to it (a smaller card's memory on a larger one)",
    )
    ap.add_argument(
        "--input-grads",
        action="store_true",
        help="make the embeddings' output need a gradient, so that the first layer holds what a middle "
        "layer of a deeper model holds (its input's gradient too): a 1-layer run's peak then stands for any depth",
    )
    ap.add_argument(
        "--peak-breakdown",
        action="store_true",
        help="one more step, untimed, with the allocator's history: what was alive at its peak (rank 0's)",
    )
    args = ap.parse_args()

    from torch.distributed.device_mesh import init_device_mesh

    from offloadkit.compose import prepare
    from offloadkit.integrations.peft_utils import apply_lora
    from offloadkit.models.blocks import find_blocks
    from offloadkit.models.zoo import build_llama
    from offloadkit.parallel import apply_context_parallel
    from offloadkit.planning import Budgets, Parallelism, plan, resolve_shape
    from offloadkit.planning.budgets import GPU_CONTEXT_BYTES
    from offloadkit.planning.capacity import longest_sequence
    from offloadkit.runtime.ranks import local_world_size

    world = int(os.environ.get("WORLD_SIZE", "1"))
    shared = torch.cuda.device_count() < local_world_size()
    torch.cuda.set_device(0 if shared else int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo" if shared else "nccl")
    rank = dist.get_rank()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    seq = world * args.tokens_per_gpu

    # One rank's plan for the whole sequence split over the ranks, within its share of the
    # host's RAM and disk, at full depth (reduced-depth runs hold the same per layer).
    gpu_bytes = None
    if args.gpu_gib is not None:
        gpu_bytes = int(args.gpu_gib * GiB)
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_bytes / total))
        gpu_bytes -= GPU_CONTEXT_BYTES  # as Budgets.detect leaves out of a card's total
    budgets = Budgets.detect(gpu_bytes=gpu_bytes)
    # Ranks sharing one GPU (over gloo) rotate all-to-all, as the GPU tests on one card do.
    asked = args.rotation or ("alltoall" if shared else "auto")
    parallel = Parallelism(world_size=world, context_parallel=True, ranks_per_host=local_world_size(), rotation=asked)
    capacity = None
    if args.tokens_per_gpu == 0:
        capacity = longest_sequence(
            resolve_shape(args.shape), lora_rank=args.lora_rank, budgets=budgets, parallel=parallel
        )
        seq = capacity.longest
        args.tokens_per_gpu = seq // world
    p = plan(resolve_shape(args.shape), seq, lora_rank=args.lora_rank, budgets=budgets, parallel=parallel)
    model = build_llama(
        args.shape,
        dtype=torch.bfloat16,
        device="cuda",
        attn_implementation="sdpa",
        num_hidden_layers=args.layers or resolve_shape(args.shape).layers,
        max_position_embeddings=max(seq, 131072),
    )
    model.config.use_cache = False
    if args.lora_rank:
        model = apply_lora(model, rank=args.lora_rank)
    if args.input_grads:
        model.enable_input_require_grads()
    model.train()
    # Realised on the layers built: one block-input place per layer the model has.
    layers = len(find_blocks(model))
    built = p.at_depth(layers)
    config = built.to_config()
    for item in args.set:
        key, _, value = item.partition("=")
        config[key] = yaml.safe_load(value)
    runtime = prepare(model, config)
    rotation = p.rotation or "allgather"  # the plan's (one rank: no ring, torch's default)
    cp = apply_context_parallel(model, mesh, rotation=rotation)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda", generator=gen)

    def step() -> float:
        with cp.step(ids, ids) as inputs, runtime.context():
            loss = model(**inputs).loss
            loss.backward()
        cp.reduce_gradients(params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(cp.reduce_loss(loss))

    recorded: dict | None = {} if args.peak_breakdown else None
    times, losses, gathered = timed_steps(step, args.warmup, args.steps, recorded)
    report = runtime.report()
    if rank == 0:
        step_s = statistics.median(times)
        flops = model_flops(resolve_shape(args.shape), args.lora_rank, seq, layers, world)
        row = {
            "shape": args.shape,
            "lora_rank": args.lora_rank,
            "world": world,
            "shared_gpu": shared,
            "layers": layers,
            "tokens": seq,
            "tokens_per_gpu": args.tokens_per_gpu,
            "step_s": step_s,
            "tokens_per_s": seq / step_s,
            # Per GPU: the model's FLOPs (attention causal, no recompute) over the step time.
            "model_tflops_per_gpu": flops / step_s / 1e12,
            "rotation": rotation,
            "overrides": args.set,
            "input_grads": args.input_grads,
            "losses": losses,
            "peak_allocated_gib": [g[0].item() for g in gathered],
            "peak_reserved_gib": [g[1].item() for g in gathered],
            "plan": p.name,
            "plan_at_depth": built.name,
            "predicted_full_depth_gpu_gib": p.memory.gpu_reserved / GiB,
            "planner_longest": capacity.longest if capacity else None,
            "planner_physical_limit": capacity.physical if capacity else None,
            "budgets_gib": {
                "gpu": budgets.gpu_bytes / GiB,
                "host": budgets.host_bytes / GiB,
                "disk": budgets.disk_bytes / GiB,
            },
            "full_depth_host_gib": p.memory.host / GiB,
            "full_depth_disk_gib": p.memory.disk / GiB,
            "predicted_gpu_gib": built.memory.gpu_reserved / GiB,
            "config": config,
            "offloaded_gib": report.get("activations", {}).get("offloaded_bytes", 0) / GiB,
            "device": torch.cuda.get_device_name(),
            "gpu_gib_cap": args.gpu_gib,
            "commit": os.environ.get("OFFLOADKIT_COMMIT"),
            "command": " ".join(["torchrun", f"--nproc_per_node {world}", *sys.argv]),
            "torch": torch.__version__,
            **(recorded or {}),
        }
        os.makedirs(args.out, exist_ok=True)
        name = f"cp-{args.shape}-{world}x{args.tokens_per_gpu}-{row['layers']}L"
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump(row, f, indent=1, default=str)
        print(
            f"RESULT world {world} tokens {seq} ({args.tokens_per_gpu}/GPU) layers {row['layers']}: "
            f"step {step_s:.2f} s, "
            f"{seq / step_s:.0f} tok/s, {flops / step_s / 1e12:.0f} model TFLOP/s per GPU, "
            f"peak {', '.join(f'{g[0].item():.2f}' for g in gathered)} GiB, "
            f"loss {losses[-1]:.4f}",
            flush=True,
        )
    cp.remove()
    runtime.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
