"""One rank of the FSDP2 planning test, started by ``torchrun`` (gloo, CPU): a tiny Llama
``fully_shard``-ed per decoder layer and then whole; the bytes of the rank's own shards against
the planner's sharded weights, and what ``prepare()`` plans for it; then what it plans for a
DDP-wrapped model, with and without gradient bucket views. Prints ``RESULT`` lines."""

import torch
import torch.distributed as dist

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import OptionSet
from offloadkit.compose import prepare
from offloadkit.layers.options import StreamingOptions
from offloadkit.models.blocks import find_blocks
from offloadkit.parallel.footprint import GATHERED_LAYERS, sharded_weights_footprint
from offloadkit.planning.memory import Workload
from offloadkit.planning.parallelism import Parallelism
from offloadkit.planning.plan import input_counts, option
from offloadkit.planning.shape import resolve_shape
from offloadkit.testing import build_llama


def main(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard

    model = build_llama("tiny", num_hidden_layers=4)
    for _, layer in find_blocks(model):
        fully_shard(layer)
    fully_shard(model)
    local = {name: p.to_local() for name, p in model.named_parameters()}
    shape = resolve_shape("tiny", layers=4)
    layers_local = sum(t.numel() for name, t in local.items() if ".layers." in name)
    w = Workload(shape, 64, lora_rank=0, dtype_bytes=4, parallel=Parallelism(world, shard_weights=True))
    planned = sharded_weights_footprint(w, OptionSet((CheckpointOptions(enabled=True),))).gpu["weights"] // 4
    root = shape.embed_params + shape.head_params + shape.hidden
    gathered = GATHERED_LAYERS * shape.layer_params
    # FSDP2 pads each parameter's dim-0 shards to equal sizes: a rank holds at most one row more.
    assert 0 <= planned - root - gathered - layers_local <= sum(1 + t.shape[-1] for n, t in local.items()), (
        planned - root - gathered,
        layers_local,
    )
    print(f"RESULT shards rank={rank} ok", flush=True)
    runtime = prepare(model, {"offload_plan": "auto", "seq_len": 64, "gradient_checkpointing": True})
    try:
        assert runtime.plan.workload.parallel.shard_weights, runtime.plan.workload.parallel
        p = runtime.plan
        assert not option(p.options, StreamingOptions).enabled and not input_counts(p.workload, p.options)[1]
    finally:
        runtime.close()
    print(f"RESULT prepare rank={rank} ok", flush=True)
    from torch.nn.parallel import DistributedDataParallel

    for view in (False, True):
        ddp = DistributedDataParallel(build_llama("tiny", num_hidden_layers=2), gradient_as_bucket_view=view)
        runtime = prepare(ddp, {"offload_plan": "auto", "seq_len": 64, "gradient_checkpointing": True})
        try:
            parallel = runtime.plan.workload.parallel
            assert parallel.ddp and parallel.bucket_view is view, parallel
            assert "DDP gradient buckets" in runtime.plan.memory.gpu_parts
        finally:
            runtime.close()
    print(f"RESULT ddp rank={rank} ok", flush=True)
    fused_under_fsdp2(rank)
    print(f"RESULT fused rank={rank} ok", flush=True)


def fused_under_fsdp2(rank: int) -> None:
    """The fused LoRA path on a fully_shard-ed LoRA model (bf16): it runs on the gathered
    weights, and the step's loss and the adapters' reduced gradients agree with PEFT's."""
    import peft
    from torch.distributed.fsdp import fully_shard

    from offloadkit.lora import apply_fused_lora
    from offloadkit.lora import fused as fused_module
    from offloadkit.testing import make_batch, randomize_lora_b

    def model(fused: bool):
        torch.manual_seed(0)
        m = build_llama("tiny", num_hidden_layers=2, dtype=torch.bfloat16)
        m = peft.get_peft_model(m, peft.LoraConfig(r=8, target_modules="all-linear"))
        randomize_lora_b(m)
        if fused:
            apply_fused_lora(m)
        for _, layer in find_blocks(m):
            fully_shard(layer)
        fully_shard(m)
        return m

    batch = make_batch(256, 2, 32, seed=rank)
    calls = []
    real = fused_module.lora_linear
    fused_module.lora_linear = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        results = []
        for fused in (False, True):
            m = model(fused)
            loss = m(**batch).loss
            loss.backward()
            grads = {n: p.grad.full_tensor().float() for n, p in m.named_parameters() if p.grad is not None}
            results.append((loss.detach().float(), grads))
    finally:
        fused_module.lora_linear = real
    assert calls, "the fused path did not run under FSDP2"
    (loss_p, grads_p), (loss_f, grads_f) = results
    assert abs(loss_f - loss_p) <= 1e-2 * abs(loss_p), (loss_f, loss_p)
    for name, g in grads_p.items():
        off = (grads_f[name] - g).norm() / g.norm().clamp_min(1e-30)
        assert off < 2.0**-4, (name, float(off))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        main(dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()
