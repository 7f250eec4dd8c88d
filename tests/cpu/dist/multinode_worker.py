"""One rank of a two-host run simulated on one machine: two ``torchrun`` launchers (node ranks
0 and 1) meet at a rendezvous on localhost, two ranks each, every host with its own spill
directory and its own RAM budget (``NODE_DIR``, ``NODE_HOST_BYTES``, set per launcher as each
host's command line would). DDP over the four ranks with block inputs offloaded to each host's
disk; the step against the same four batches in one process. Prints ``RESULT multinode``.

On CPU over gloo by default; with ``OFFLOADKIT_TEST_DEVICE=cuda``, one GPU a rank over NCCL
(each launcher given its host's GPUs by ``CUDA_VISIBLE_DEVICES``): the block inputs then go
device -> pinned RAM -> this host's disk and back."""

import os

import torch
import torch.distributed as dist

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.compose import run_parallelism
from offloadkit.planning import Budgets
from offloadkit.storage.disk import DiskOptions
from offloadkit.testing import build_llama, make_batch


DEVICE = os.environ.get("OFFLOADKIT_TEST_DEVICE", "cpu")


def main() -> None:
    from torch.nn.parallel import DistributedDataParallel

    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node_dir = os.environ["NODE_DIR"]
    host_bytes = int(os.environ["NODE_HOST_BYTES"])

    # What one rank may use: its host's RAM and disk shared by the ranks on that host only.
    parallel = run_parallelism()
    assert (parallel.world_size, parallel.ranks_per_host) == (4, 2), parallel
    budgets = Budgets.detect(gpu_bytes=1 << 30, host_bytes=host_bytes, disk_bytes=8 << 30, disk_dir=node_dir)
    assert budgets.host_bytes == host_bytes // 2 and budgets.disk_bytes == (8 << 30) // 2, budgets

    torch.manual_seed(0)
    device = torch.device(DEVICE, torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    reference = build_llama("tiny", num_hidden_layers=3).to(device)
    model = DistributedDataParallel(build_llama("tiny", num_hidden_layers=3).to(device))
    # Block inputs spill to this host's own directory (CPU tensors: offloaded explicitly).
    handle = apply_activation_checkpointing(
        model.module, offload_inputs=True, offload_cpu_tensors=DEVICE == "cpu", storage="disk",
        disk=DiskOptions(directory=node_dir),
    )
    for step in range(2):
        model.zero_grad(set_to_none=True)
        loss = model(**make_batch(256, 2, 32, seed=10 * step + rank, device=device)).loss
        loss.backward()
        reference.zero_grad(set_to_none=True)
        for r in range(world):
            (reference(**make_batch(256, 2, 32, seed=10 * step + r, device=device)).loss / world).backward()
        for (name, p), q in zip(model.module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=f"grad {name}")
        with torch.no_grad():
            for p, q in zip(model.module.parameters(), reference.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
    stats = handle.offloader.stats
    assert stats.offloaded_bytes > 0, stats
    spilled = os.listdir(node_dir)  # this host's private spill directories (removed with the handle)
    assert spilled, "nothing spilled to this host's directory"
    handle.remove()
    print(f"RESULT multinode rank={rank} node_dir={node_dir} spill_dirs={len(spilled)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
