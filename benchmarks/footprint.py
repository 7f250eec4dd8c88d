"""Full-depth host and disk footprint of a long-context plan, run for real without the compute.

The capacity probes past 128K run 2 layers of the 8B shape (the GPU peak does not depend on
depth); what depth does change is where the block inputs wait: at 640K tokens, 31 inputs of
5 GiB, in pinned RAM up to the host budget and on disk past it, beside 13 GiB of streamed
frozen weights. This probe builds a model of the plan's full depth whose layers hold the
real frozen weight bytes and pass ``[1, S, hidden]`` bf16 block inputs on, but compute only
``x * scale`` (a trainable scalar per layer), followed by what the final norm and the head's
input save (kept on the GPU as what backward needs first), and runs one training step through
``prepare()`` with the plan's config: the same checkpointing, tiered storage, host budget,
prefetch horizon and layer streaming as the real step. It measures peak RSS, pinned bytes,
bytes written to disk and the step time, and checks every restored block input: each
layer's scale gradient is ``sum(x)`` of its restored input, which must equal, bit for bit,
the same reduction over the original.

A full fine-tune (``--lora-rank 0``) keeps its weights trainable instead: each layer holds the
real bf16 weight bytes as one trainable tensor (and one more tensor stands for the embedding
and the head), touched in forward by a zero-weighted sum so that backward gives each a real
full-size gradient. :class:`~offloadkit.optim.BackwardAdamW` with the plan's precision updates
them in backward, its state in host memory: the run then holds the optimizer state the plan
counts beside the block inputs in RAM and on disk.

    PYTHONPATH=$PWD python3 benchmarks/footprint.py --shape llama-3-8b --lora-rank 16 --seq-len 655360 --out results/
    PYTHONPATH=$PWD python3 benchmarks/footprint.py --shape llama-3-8b --lora-rank 0 --seq-len 0 --out results/

One rank of a sequence split over N GPUs by context parallelism (``--world-size N`` under
``torchrun --nproc_per_node N``): each process plans its rank as ``offload_plan: auto`` does
under a process group (``--seq-len`` is the whole sequence; 0: the planner's longest over the
N ranks, all-to-all rotation), the host's RAM and disk shared by the ranks on it, and runs its
share of the tokens through the stand-in at full depth, all ranks at once: their pinned RAM
and disk are held together, as in the real step. Nothing crosses ranks (the stand-in has no
attention); a gloo group only lets the ranks read the host's RAM before any of them takes
some and agree on one length.

    torchrun --standalone --nproc_per_node 4 benchmarks/footprint.py --lora-rank 16 --seq-len 0 \
        --world-size 4 --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import psutil
import torch
import torch.distributed as dist
from torch import nn

GiB = float(1 << 30)


def _touch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged, with ``weight`` in the graph: backward gives it a full-size (zero) gradient."""
    return x + (weight.sum() * 0).to(x.dtype)


class Layer(nn.Module):
    """A decoder layer's weight bytes (frozen, or trainable for a full fine-tune) and a
    trainable scale; forward is ``x * scale``."""

    def __init__(self, hidden: int, weight_elements: int, trainable: bool = False) -> None:
        super().__init__()
        rows = max(1, weight_elements // hidden)
        weight = torch.zeros(rows, hidden, dtype=torch.bfloat16, device="cuda")
        self.frozen = nn.Parameter(weight, requires_grad=trainable)
        self.scale = nn.Parameter(torch.ones((), device="cuda"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale.to(x.dtype)
        return _touch(x, self.frozen) if self.frozen.requires_grad else x


class Stack(nn.Module):
    def __init__(self, layers: int, hidden: int, weight_elements: int, edge_elements: int = 0) -> None:
        super().__init__()
        trainable = edge_elements > 0
        self.layers = nn.ModuleList(Layer(hidden, weight_elements, trainable) for _ in range(layers))
        # A full fine-tune's embedding and head: trained, updated and stateful like the layers.
        edges = torch.zeros(edge_elements, dtype=torch.bfloat16, device="cuda")
        self.edges = nn.Parameter(edges) if trainable else None
        self.trainable = trainable
        self.norm_scales = nn.Parameter(torch.ones(3, device="cuda"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.edges is not None:
            x = _touch(x, self.edges)
        for layer in self.layers:
            x = layer(x)
        return x + self._final_norm_saves(x)

    def _final_norm_saves(self, x: torch.Tensor) -> torch.Tensor:
        """Zero, saving what the final norm and the head's input save after the last layer
        (``final_norm_bytes``): the fp32 input and the bf16 output (and, training the norm, its
        bf16 normalised value). They stay on the GPU, saved after the last block. Detached from ``x``,
        so the layers' gradients stay exactly 1."""
        x = x.detach()
        s = self.norm_scales
        saved = [x.float() * s[0], x * s[1].to(x.dtype)]  # each mul saves its tensor operand
        if self.trainable:
            saved.append(x.clone() * s[2].to(x.dtype))
        return sum(t.sum() for t in saved).to(x.dtype) * 0


def _sample_rss(peak: list, stop: threading.Event) -> None:
    proc = psutil.Process()
    while not stop.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        stop.wait(0.1)


def run(
    shape_name: str, seq: int, lora_rank: int, disk_dir: str | None, world: int = 1, gpu_gib: float | None = None
) -> dict:
    from offloadkit.compose import prepare
    from offloadkit.planning import Budgets, Parallelism, plan, resolve_shape
    from offloadkit.planning.budgets import GPU_CONTEXT_BYTES
    from offloadkit.runtime.ranks import global_rank, local_rank, local_world_size, world_size

    shape = resolve_shape(shape_name)
    parallel = None
    if world > 1:
        if world != world_size():
            raise SystemExit(f"--world-size {world}: run it under torchrun --nproc_per_node {world} (WORLD_SIZE)")
        torch.cuda.set_device(local_rank())
        parallel = Parallelism(world, context_parallel=True, ranks_per_host=local_world_size(), rotation="alltoall")
        # Every rank reads the host's RAM before any of them takes some, and all plan one length.
        dist.init_process_group("gloo")
    gpu_bytes = None
    if gpu_gib is not None:  # plan (and cap this process) as on a card of gpu_gib, e.g. an H100's on an H200
        gpu_bytes = int(gpu_gib * GiB)
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_bytes / total))
        gpu_bytes -= GPU_CONTEXT_BYTES  # as Budgets.detect leaves out of a card's total
    budgets = Budgets.detect(disk_dir=disk_dir, gpu_bytes=gpu_bytes)
    if seq <= 0:  # the planner's longest full-depth sequence under the budgets read here
        from offloadkit.planning import longest_sequence

        seq = longest_sequence(shape, lora_rank=lora_rank, budgets=budgets, parallel=parallel).longest
    if world > 1:
        agreed = torch.tensor([seq])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        seq = int(agreed) // (2 * world) * (2 * world)  # load-balanced shards: two pieces a rank
        dist.destroy_process_group()  # the stand-in's ranks exchange nothing
    p = plan(shape, seq, lora_rank=lora_rank, budgets=budgets, parallel=parallel)
    config = dict(
        p.to_config(),
        chunked_cross_entropy=False,
        chunked_cross_entropy_num_chunks=None,
        tiled_mlp=False,
        tiled_mlp_num_shards=None,
        tiled_projections=False,
    )
    # The stand-in's layers have no attention: the split is only the rank's share of tokens.
    for key in ("context_parallel", "context_parallel_rotation", "attention_head_groups", "keep_attention_outputs"):
        config.pop(key, None)
    tokens = seq // world
    if disk_dir:
        config["disk_dir"] = disk_dir
    out: dict = {
        "shape": shape.name,
        "layers": shape.layers,
        "seq_len": seq,
        "world_size": world,
        "rank": global_rank(),
        "ranks_per_host": local_world_size(),
        "tokens_this_rank": tokens,
        "fits": p.fits,
        "plan": p.name,
        "placement": "".join("x" if x == "recompute" else x[0] for x in p.placement),  # x: recomputed
        "recomputed_inputs": p.placement.count("recompute"),
        "config": config,
        "budgets_gib": {
            "gpu": budgets.gpu_bytes / GiB,
            "host": budgets.host_bytes / GiB,
            "disk": budgets.disk_bytes / GiB,
        },
        "predicted": {"host_gib": p.memory.host / GiB, "disk_gib": p.memory.disk / GiB},
        "device": torch.cuda.get_device_name(),
        "gpu_gib_cap": gpu_gib,
        "torch": torch.__version__,
    }
    full = lora_rank == 0
    weights = shape.layer_params if lora_rank or full else 0
    model = Stack(shape.layers, shape.hidden, weights, shape.embed_params + shape.head_params if full else 0)
    t0 = time.perf_counter()
    runtime = prepare(model, config)
    optimizer = None
    if full and config.get("optimizer_offloading"):
        from offloadkit.optim import BackwardAdamW

        optimizer = BackwardAdamW.for_precision(
            [p for n, p in model.named_parameters() if not n.endswith(("scale", "norm_scales"))],
            config.get("optimizer_precision", "params"),
            lr=0.0,  # the state is what is measured; the weights stay as they are
        )
    out["prepare_s"] = time.perf_counter() - t0
    x_gpu = torch.randn(1, tokens, shape.hidden, dtype=torch.bfloat16, device="cuda")
    # What every layer's scale gradient must be: its input is x (all scales are 1).
    probe = torch.ones((), device="cuda", requires_grad=True)
    (expected,) = torch.autograd.grad((x_gpu * probe.to(x_gpu.dtype)).sum(), probe)

    peak, stop = [0], threading.Event()
    sampler = threading.Thread(target=_sample_rss, args=(peak, stop), daemon=True)
    sampler.start()
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with runtime.context():
            loss = model(x_gpu).sum()
        torch.cuda.synchronize()
        out["forward_s"] = time.perf_counter() - t0
        out["host_held_after_forward_gib"] = runtime.manager.host_bytes() / GiB
        out["on_disk_after_forward_gib"] = (runtime.manager.storage_stats().get("disk") or {}).get(
            "bytes_on_disk", 0
        ) / GiB
        loss.backward()
        torch.cuda.synchronize()
        out["step_s"] = time.perf_counter() - t0
    except Exception as exc:
        # Where the bytes were when it failed: the split between RAM and disk, and who held the budget.
        out["error"] = repr(exc)
        out["storage_at_failure"] = runtime.manager.storage_stats()
        out["host_budget_at_failure"] = runtime.manager.budget.describe()
        out["streamed_weights_host_gib"] = runtime.streamer.pool.bytes_held / GiB if runtime.streamer else None
        print(json.dumps(out, indent=2, default=str))
        raise
    finally:
        stop.set()
        sampler.join()
    grads = [layer.scale.grad for layer in model.layers]
    out["restored_inputs_exact"] = all(g is not None and torch.equal(g, expected) for g in grads)
    if optimizer is not None:
        optimizer.step()  # the updates happened in backward; this ends the pass
        torch.cuda.synchronize()
        state = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
        out["optimizer_state_host_gib"] = sum(t.numel() * t.element_size() for t in state) / GiB
        out["optimizer_state_pinned"] = all(t.is_pinned() for t in state)
        out["trainable_params"] = sum(q.numel() for q in model.parameters() if q.requires_grad)
        out["predicted"]["optimizer_state_gib"] = out["trainable_params"] * p.workload.optimizer_state_bytes / GiB
        out["gradients_left"] = sum(q.grad is not None for q in model.parameters() if q.ndim > 0)
    report = runtime.report()
    storage = report.get("storage") or {}
    disk = storage.get("disk") or {}
    out["peak_rss_gib"] = peak[0] / GiB
    out["disk_written_gib"] = disk.get("bytes_written", 0) / GiB
    out["disk_read_gib"] = disk.get("bytes_read", 0) / GiB
    out["disk_fallbacks"] = disk.get("fallbacks", 0)
    out["disk_write_gb_s"], out["disk_read_gb_s"] = disk.get("write_gb_s"), disk.get("read_gb_s")
    out["offloaded_gib"] = report["activations"]["offloaded_bytes"] / GiB
    out["streamed_weights_gib"] = (report.get("layer_streaming") or {}).get("streamed_bytes", 0) / GiB
    out["peak_gpu_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
    out["streamed_weights_host_gib"] = runtime.streamer.pool.bytes_held / GiB if runtime.streamer else None
    out["host_budget_peak_gib"] = runtime.manager.budget.peak_bytes / GiB
    out["tiered"] = storage.get("tiered")
    runtime.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--seq-len", type=int, required=True, help="0: the planner's longest under this machine's budgets")
    ap.add_argument("--disk-dir", default=None)
    ap.add_argument("--out", default="footprint-results")
    ap.add_argument("--world-size", type=int, default=1, help="one rank of a context-parallel split over N (torchrun)")
    ap.add_argument("--gpu-gib", type=float, default=None, help="plan for (and cap each process to) this GPU memory")
    args = ap.parse_args(argv)
    result = run(args.shape, args.seq_len, args.lora_rank, args.disk_dir, args.world_size, args.gpu_gib)
    os.makedirs(args.out, exist_ok=True)
    name = f"footprint-{args.shape}-{result['seq_len']}"
    if args.world_size > 1:
        name += f"-rank{result['rank']}of{args.world_size}"
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["restored_inputs_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
