"""One rank of a context-parallel check on CUDA, started by ``torchrun``: PyTorch's ring
attention under offloadkit's context parallelism against the single-process step, bf16.

With one GPU, both ranks share it over gloo (NCCL refuses two ranks on one device) and keys
and values rotate with all-to-all (gloo's all-gather of CUDA tensors through functional
collectives crashes); with a GPU per rank, NCCL and the default rotation."""

import copy
import os
import sys

import torch
import torch.distributed as dist

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.longctx import apply_chunked_loss, apply_tiled_mlp
from offloadkit.parallel import apply_context_parallel
from offloadkit.testing import build_llama, make_batch


def main(variant: str) -> None:
    stack = variant != "plain"
    world = int(os.environ["WORLD_SIZE"])
    shared = torch.cuda.device_count() < world
    torch.cuda.set_device(0 if shared else int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo" if shared else "nccl")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    reference = build_llama("small", dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa")
    batch = make_batch(2048, 2, 512, device="cuda", seed=3)
    labels = batch["labels"].clone()
    labels[:, :17] = -100
    loss_ref = reference(input_ids=batch["input_ids"], labels=labels).loss
    loss_ref.backward()
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    handles = []
    if stack:
        handles = [apply_chunked_loss(model, 2), apply_tiled_mlp(model, 2),
                   apply_activation_checkpointing(model, offload_inputs=True, keep_attention=variant == "kept")]
    cp = apply_context_parallel(model, mesh, rotation="alltoall" if shared else "allgather")
    with cp.step(batch["input_ids"], labels) as inputs:
        loss = model(**inputs).loss
        loss.backward()
    cp.reduce_gradients()
    total = cp.reduce_loss(loss)
    torch.testing.assert_close(total.float(), loss_ref.detach().float(), rtol=2e-2, atol=2e-2)
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters()):
        err = ((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm().clamp_min(1e-12)).item()
        worst = max(worst, err)
    assert worst < 0.05, f"relative gradient error {worst:.3g}"
    if stack:
        assert handles[2].offloader.stats.offloaded_tensors > 0
    if variant == "kept":
        # Ring attention's outputs (DTensors) kept in forward and handed to the recompute.
        stats = handles[2].attention_stats
        layers = len(model.model.layers)
        assert (stats.kept, stats.replayed, stats.ran_again) == (layers, layers, 0), stats
    cp.remove()
    print(f"RESULT cp rank={dist.get_rank()} variant={variant} loss {total.item():.5f} ref {loss_ref.item():.5f} "
          f"grad err {worst:.2e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
