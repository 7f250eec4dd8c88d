"""The peer for context-parallel runs: Hugging Face accelerate's FSDP2 with context
parallelism (``ParallelismConfig(cp_size=N)``, PyTorch's ring attention underneath, the stack
TRL's long-context recipe builds), on the same model and tokens as
``benchmarks/context_parallel.py``, for a side-by-side on the same machine.

The peer as its documentation sets it up: FSDP2 over every rank (the frozen base sharded),
accelerate's activation checkpointing of every decoder layer, bf16 mixed precision (the
adapters upcast to fp32 by accelerate), ``accelerator.maybe_context_parallel`` sharding the
input ids, position ids and pre-shifted labels along the sequence, the model's own loss.
No offloading of any kind. One warm-up step (optional), then timed steps (forward, backward,
AdamW on the adapters); the record has the same fields as ``context_parallel.py``'s, so
``model_tflops_per_gpu`` counts the same FLOPs.

    accelerate is on the GPU machines; run one process per GPU:
    torchrun --nproc_per_node 4 benchmarks/cp_peer.py --tokens-per-gpu 65536 --out bench-results/cp

A run that runs out of GPU memory prints ``OOM`` and exits 3 (a capacity ladder's stop).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.context_parallel import GiB, model_flops, timed_steps  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--tokens-per-gpu", type=int, default=65536)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rotation", choices=("allgather", "alltoall"), default="allgather")
    ap.add_argument(
        "--gpu-gib", type=float, default=None, help="cap the process to this much GPU memory (an H100's on an H200)"
    )
    ap.add_argument("--out", default="bench-results/cp")
    args = ap.parse_args()

    try:
        from accelerate import Accelerator
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import FullyShardedDataParallelPlugin, TorchContextParallelConfig
    except ImportError as exc:  # pragma: no cover - the peer's own package
        raise SystemExit(f"the peer needs accelerate >= 1.10 (pip install accelerate): {exc}") from exc

    from offloadkit.integrations.peft_utils import apply_lora
    from offloadkit.models.zoo import build_llama
    from offloadkit.planning import resolve_shape

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if args.gpu_gib is not None:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_gib * GiB / total))
    seq = world * args.tokens_per_gpu
    shape = resolve_shape(args.shape)
    layers = args.layers or shape.layers
    parallelism = ParallelismConfig(
        dp_shard_size=1, cp_size=world, cp_handler=TorchContextParallelConfig(cp_comm_strategy=args.rotation)
    )
    fsdp = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        activation_checkpointing=True,
        reshard_after_forward=True,
    )
    accelerator = Accelerator(parallelism_config=parallelism, fsdp_plugin=fsdp, mixed_precision="bf16")
    model = build_llama(
        args.shape,
        dtype=torch.bfloat16,
        device="cuda",
        attn_implementation="sdpa",
        num_hidden_layers=layers,
        max_position_embeddings=max(seq, 131072),
    )
    model.config.use_cache = False
    if args.lora_rank:
        model = apply_lora(model, rank=args.lora_rank)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    model, opt = accelerator.prepare(model, opt)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids_full = torch.randint(0, shape.vocab, (1, seq), device="cuda", generator=gen)

    def step() -> float:
        # The buffers are sharded in place by the context: fresh ones every step.
        ids = ids_full.clone()
        positions = torch.arange(seq, device="cuda").unsqueeze(0)
        shifted = torch.full_like(ids, -100)
        shifted[:, :-1] = ids[:, 1:]
        buffers = [ids, positions, shifted]
        with accelerator.maybe_context_parallel(
            buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)
        ):
            loss = model(input_ids=ids, position_ids=positions, labels=shifted, shift_labels=shifted).loss
            accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total) / world

    try:
        times, losses, gathered = timed_steps(step, args.warmup, args.steps)
    except torch.OutOfMemoryError as exc:
        print(f"OOM rank {dist.get_rank()} at {seq} tokens ({args.tokens_per_gpu}/GPU): {str(exc)[:200]}", flush=True)
        os._exit(3)  # the other ranks wait in a collective: leave without tearing the group down
    if dist.get_rank() == 0:
        import accelerate

        step_s = statistics.median(times)
        flops = model_flops(shape, args.lora_rank, seq, layers, world)
        row = {
            "stack": "accelerate FSDP2 + context parallel + activation checkpointing",
            "shape": args.shape,
            "lora_rank": args.lora_rank,
            "world": world,
            "layers": layers,
            "tokens": seq,
            "tokens_per_gpu": args.tokens_per_gpu,
            "step_s": step_s,
            "step_times_s": times,
            "tokens_per_s": seq / step_s,
            "model_tflops_per_gpu": flops / step_s / 1e12,
            "rotation": args.rotation,
            "losses": losses,
            "peak_allocated_gib": [g[0].item() for g in gathered],
            "peak_reserved_gib": [g[1].item() for g in gathered],
            "device": torch.cuda.get_device_name(),
            "gpu_gib_cap": args.gpu_gib,
            "commit": os.environ.get("OFFLOADKIT_COMMIT"),
            "command": " ".join(["torchrun", f"--nproc_per_node {world}", *sys.argv]),
            "torch": torch.__version__,
            "accelerate": accelerate.__version__,
        }
        os.makedirs(args.out, exist_ok=True)
        name = f"peer-{args.shape}-{world}x{args.tokens_per_gpu}-{layers}L"
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump(row, f, indent=1, default=str)
        print(
            f"RESULT peer world {world} tokens {seq} ({args.tokens_per_gpu}/GPU) layers {layers}: step {step_s:.2f} s, "
            f"{seq / step_s:.0f} tok/s, {flops / step_s / 1e12:.0f} model TFLOP/s per GPU, "
            f"peak {', '.join(f'{g[0].item():.2f}' for g in gathered)} GiB, loss {losses[-1]:.4f}",
            flush=True,
        )
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
