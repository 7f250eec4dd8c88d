"""One rank of a distributed CPU test, started by ``torchrun`` (gloo): DDP and FSDP2 with
offloading against the same run without it. Prints one ``RESULT`` line per check."""

import sys

import torch
import torch.distributed as dist

from offloadkit import get_act_offloading_ctx_manager
from offloadkit.testing.cpu_streaming import stream_layers_on_cpu
from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.testing import build_llama, make_batch


def batch_for(rank, step):
    return make_batch(256, 2, 32, seed=100 * step + rank)


def ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(build_llama("tiny"))
    reference = build_llama("tiny")  # same seed: same weights
    ctx = get_act_offloading_ctx_manager(model, offload_cpu_tensors=True, min_offload_size=0)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        with ctx:
            loss = model(**batch_for(rank, step)).loss
        loss.backward()
        # reference: both ranks' batches in one process, gradients averaged as DDP does
        reference.zero_grad(set_to_none=True)
        ref_losses = []
        for r in range(world):
            out = reference(**batch_for(r, step)).loss
            (out / world).backward()
            ref_losses.append(out.detach())
        assert torch.equal(loss.detach(), ref_losses[rank]), "loss differs from the single-process run"
        for (name, p), q in zip(model.module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=f"grad {name}")
        with torch.no_grad():
            for p, q in zip(model.module.parameters(), reference.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
    assert ctx.stats.offloaded_tensors > 0 and ctx.is_idle()
    print(f"RESULT ddp rank={rank} ok", flush=True)


def fsdp2(rank, world):
    from torch.distributed.fsdp import fully_shard

    def sharded():
        model = build_llama("small")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    plain, offloaded = sharded(), sharded()
    plain_ckpt = apply_activation_checkpointing(plain)
    handle = apply_activation_checkpointing(offloaded, offload_inputs=True, offload_cpu_tensors=True)
    for step in range(2):
        batch = make_batch(2048, 2, 64, seed=10 * step + rank)
        losses = []
        for model in (plain, offloaded):
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses), f"losses differ: {losses}"
        for (name, a), b in zip(plain.named_parameters(), offloaded.parameters()):
            assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), f"grad {name} differs"
    stats = handle.offloader.stats
    assert stats.offloaded_tensors > 0 and stats.kept_by_reason.get("parameter", 0) >= 0
    assert handle.offloader.is_idle()
    plain_ckpt.remove()
    print(f"RESULT fsdp2 rank={rank} ok offloaded={stats.offloaded_bytes}", flush=True)


def fail(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(build_llama("tiny"))
    ctx = get_act_offloading_ctx_manager(model, offload_cpu_tensors=True, min_offload_size=0)
    for step in range(3):
        with ctx:
            loss = model(**batch_for(rank, step)).loss
            if rank == 1 and step == 1:
                raise ValueError("rank 1 failed in its forward")
        loss.backward()  # rank 0 waits in the gradient all-reduce for a peer that is gone
    print(f"RESULT fail rank={rank} finished", flush=True)


def stream_fsdp2(rank, world):
    from torch.distributed.fsdp import fully_shard

    model = build_llama("tiny")
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        fully_shard(layer)
    try:
        stream_layers_on_cpu(model)
    except ValueError as exc:
        print(f"RESULT stream_fsdp2 rank={rank} refused: {exc}", flush=True)


def cp(rank, world):
    """Context parallelism on CPU (all-gather attention): one sequence split over the ranks, with
    checkpointing, block inputs offloaded to disk-free host buffers, the chunked loss and the
    tiled MLP; the ranks' losses and gradients add up to the single-process step."""
    import copy

    from offloadkit.longctx import apply_chunked_loss, apply_tiled_mlp
    from offloadkit.parallel import apply_context_parallel

    reference = build_llama("tiny", attn_implementation="sdpa", num_key_value_heads=2)
    batch = make_batch(256, 2, 64, seed=7)
    labels = batch["labels"].clone()
    labels[:, :5] = -100  # a prompt that is not trained on
    loss_ref = reference(input_ids=batch["input_ids"], labels=labels).loss
    loss_ref.backward()

    for stack in (False, True):
        model = copy.deepcopy(reference)
        model.zero_grad(set_to_none=True)
        handles = []
        if stack:
            handles = [apply_chunked_loss(model, 3), apply_tiled_mlp(model, 2),
                       apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True)]
        cpar = apply_context_parallel(model)
        with cpar.step(batch["input_ids"], labels) as inputs:
            assert inputs["input_ids"].shape == (2, 64 // world)
            loss = model(**inputs).loss
            loss.backward()
        cpar.reduce_gradients()
        total = cpar.reduce_loss(loss)
        torch.testing.assert_close(total, loss_ref.detach(), rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"grad {name}")
        if stack:
            assert handles[2].offloader.stats.offloaded_tensors > 0
        try:  # a step that fails leaves the next one usable
            with cpar.step(batch["input_ids"], labels):
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        try:
            with cpar.step(batch["input_ids"][:, :63], labels[:, :63]):
                pass
            raise AssertionError("an odd length must be refused")
        except ValueError as exc:
            assert "multiple of" in str(exc)
        with cpar.step(batch["input_ids"], labels) as inputs:
            model(**inputs).loss.backward()
        cpar.remove()
        assert model.config._attn_implementation == "sdpa"
        for h in handles:
            h.remove()
    print(f"RESULT cp rank={rank} ok", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        globals()[sys.argv[1]](dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()
