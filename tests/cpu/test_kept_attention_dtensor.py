"""Kept attention outputs when attention runs on DTensors (as context parallelism's ring
attention hands them back): the local bytes are kept and the recompute gets DTensors laid out
alike, gradients bitwise those of the full recompute; and attention over head groups on
DTensors, the gradients those of one call. On CPU, one rank over gloo, the CPU
attention kernel given a batch-sharded strategy (DTensor has none for it)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a gloo process group on Linux")

SCRIPT = textwrap.dedent(
    """
    import os, socket
    import torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import register_sharding

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    ops = torch.ops.aten

    @register_sharding(ops._scaled_dot_product_flash_attention_for_cpu.default)
    def _forward(query, key, value, *args, **kwargs):
        return [([Shard(0), Shard(0)], [Shard(0)] * 3 + [None] * (len(args) + len(kwargs)))]

    @register_sharding(ops._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _backward(grad_out, query, key, value, out, lse, *args, **kwargs):
        return [([Shard(0)] * 3, [Shard(0)] * 6 + [None] * (len(args) + len(kwargs)))]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.o = nn.Linear(64, 192), nn.Linear(64, 64)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 128, 3, 4, 16).permute(2, 0, 3, 1, 4)
            q, k, v = (DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert isinstance(out, DTensor)
            return x + self.o(out.to_local().transpose(1, 2).reshape(2, 128, 64))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.square().mean()

    from offloadkit.checkpointing import apply_activation_checkpointing

    grads = []
    for keep in (False, True):
        torch.manual_seed(0)
        model, x = Model(), torch.randn(2, 128, 64)
        handle = apply_activation_checkpointing(
            model, offload_inputs=True, offload_cpu_tensors=True, keep_attention=keep, block_types=(Block,)
        )
        model(x).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        stats = handle.attention_stats
        handle.remove()
    assert (stats.kept, stats.replayed, stats.ran_again) == (3, 3, 0), stats
    assert all(torch.equal(a, b) for a, b in zip(*grads)), "gradients differ from the full recompute"

    # Head groups over DTensors, the output's gradient laid out otherwise (copied into the
    # kernel's layout on the local tensor): the gradients of one whole call.
    from offloadkit.longctx.attention_groups import grouped_attention

    torch.manual_seed(1)
    leaves = [torch.randn(2, 4, 128, 16, requires_grad=True) for _ in range(3)]
    grad_local = torch.randn(2, 128, 4, 16).transpose(1, 2)
    results = []
    for grouped in (False, True):
        q, k, v = (DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for t in leaves)
        out = grouped_attention(2, q, k, v, is_causal=True) if grouped else F.scaled_dot_product_attention(
            q, k, v, is_causal=True
        )
        assert isinstance(out, DTensor)
        out.backward(DTensor.from_local(grad_local, mesh, [Shard(0)], run_check=False))
        results.append([t.grad.clone() for t in leaves])
        for t in leaves:
            t.grad = None
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    dist.destroy_process_group()
    print("RESULT ok")
    """
)


def test_dtensor_attention_outputs_are_kept_and_replayed_bitwise():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0 and "RESULT ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
