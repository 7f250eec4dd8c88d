"""Sequence-tiled MLP against the untiled module.

Tolerances, relative to the largest reference value: fp64 1e-10 and fp32 1e-5 (the same
maths over fewer rows at a time); bf16: no further from an fp64 reference than 1.5 times
the untiled bf16 result is, plus 1e-3 (parameter gradients are summed over shards in fp32,
each shard's product rounded to bf16 once).
"""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from offloadkit import apply_tiled_mlp
from offloadkit.longctx.tiled_mlp import auto_num_shards, tiled_forward
from offloadkit.testing import AllocationTracker, SavedTensorTracker

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


class SwiGLU(nn.Module):
    def __init__(self, hidden=16, intermediate=256, dropout=0.0):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=True)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.down_proj(self.drop(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.mlp = SwiGLU(**kw)

    def forward(self, x):
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, layers=2, **kw):
        super().__init__()
        self.layers = nn.ModuleList(Block(**kw) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def close(got, ref, tol, what=""):
    scale = ref.abs().max().item() or 1.0
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def step(net, x, upstream):
    """Forward + backward with a fixed upstream gradient; returns output and all grads."""
    x = x.detach().clone().requires_grad_()
    net.zero_grad(set_to_none=True)
    out = net(x)
    out.backward(upstream)
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def inputs(dtype, batch=2, seq=37, hidden=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64).to(dtype)
    up = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64).to(dtype)
    return x, up


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shards", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 2])
def test_parity_full_precision(dtype, shards, batch):
    net = Net().to(dtype)
    x, up = inputs(dtype, batch=batch)
    ref = step(net, x, up)
    handle = apply_tiled_mlp(net, num_shards=shards)
    assert [n for n, _ in handle.modules] == ["layers.0.mlp", "layers.1.mlp"]
    got = step(net, x, up)
    close(got[0], ref[0], TOL[dtype], "output")
    close(got[1], ref[1], TOL[dtype], "input grad")
    assert got[2].keys() == ref[2].keys()
    for name in ref[2]:
        close(got[2][name], ref[2][name], TOL[dtype], name)
    handle.remove()
    assert all("forward" not in m.__dict__ for m in net.modules())


def test_bf16_no_worse_than_untiled():
    net = Net(intermediate=512)
    x, up = inputs(torch.float64, seq=96)
    exact = step(net.double(), x, up)
    net = net.bfloat16()
    low = [t.bfloat16() for t in (x, up)]
    ref = step(net, *low)
    handle = apply_tiled_mlp(net, num_shards=6)
    got = step(net, *low)
    handle.remove()
    pairs = [("output", got[0], ref[0], exact[0]), ("input grad", got[1], ref[1], exact[1])]
    pairs += [(n, got[2][n], ref[2][n], exact[2][n]) for n in exact[2]]
    for name, g, r, e in pairs:
        scale = e.abs().max().item()
        err_got = (g.double() - e).abs().max().item() / scale
        err_ref = (r.double() - e).abs().max().item() / scale
        assert err_got <= 1.5 * err_ref + 1e-3, f"{name}: tiled {err_got:.2e} vs untiled {err_ref:.2e}"


def test_gradient_accumulation_and_one_gradient_per_parameter():
    net = Net().double()
    x, up = inputs(torch.float64)
    ref = step(net, x, up)
    handle = apply_tiled_mlp(net, num_shards=4)
    counts = {}
    hooks = []
    for name, p in net.named_parameters():
        p.grad = torch.ones_like(p)
        hooks.append(
            p.register_post_accumulate_grad_hook(lambda p, n=name: counts.__setitem__(n, counts.get(n, 0) + 1))
        )
    xx = x.clone().requires_grad_()
    net(xx).backward(up)
    assert counts == {n: 1 for n, _ in net.named_parameters()}, "each parameter must get one gradient per backward"
    for name, p in net.named_parameters():
        close(p.grad, ref[2][name] + 1, TOL[torch.float64], name)
    for h in hooks:
        h.remove()
    handle.remove()


def test_dropout_masks_replayed_in_backward():
    """With dropout, backward must recompute each shard with the masks forward drew: the
    result equals running the same shards with grad, in order, from the same RNG state."""
    net = Net(layers=1, dropout=0.3).double()
    mlp = net.layers[0].mlp
    x, up = inputs(torch.float64, seq=40)
    torch.manual_seed(123)
    xs = x.clone().requires_grad_()
    # Shards run over the tokens of every batch row in turn (2 x 40 tokens, 4 shards).
    flat = xs.reshape(1, -1, xs.shape[-1])
    bounds = [(0, 20), (20, 20), (40, 20), (60, 20)]
    ref_out = torch.cat([mlp(flat[:, s : s + n]) for s, n in bounds], dim=1).view(x.shape)
    ref_out.backward(up)
    ref = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    net.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    xt = x.clone().requires_grad_()
    params = [p for p in mlp.parameters() if p.requires_grad]
    out = tiled_forward(mlp.forward, xt, 4, params)
    torch.manual_seed(999)  # backward must not depend on the RNG state at backward time
    out.backward(up)
    close(out.detach(), ref_out.detach(), TOL[torch.float64], "output")
    close(xt.grad, xs.grad, TOL[torch.float64], "input grad")
    for n, p in mlp.named_parameters():
        close(p.grad, ref[n], TOL[torch.float64], n)


@pytest.mark.parametrize("reentrant", [False, True])
def test_inside_activation_checkpointing(reentrant):
    net = Net().double()
    x, up = inputs(torch.float64)
    ref = step(net, x, up)
    handle = apply_tiled_mlp(net, num_shards=3)
    for layer in net.layers:
        layer.forward = lambda x, f=layer.forward: checkpoint(f, x, use_reentrant=reentrant)
    got = step(net, x, up)
    for name in ref[2]:
        close(got[2][name], ref[2][name], TOL[torch.float64], name)
    close(got[1], ref[1], TOL[torch.float64], "input grad")
    handle.remove()


def test_holds_one_shard_and_saves_only_the_input():
    batch, seq, hidden, inter, shards = 2, 64, 16, 256, 4
    net = Net(intermediate=inter)
    x, up = inputs(torch.float32, batch=batch, seq=seq)
    full = batch * seq * inter
    with AllocationTracker() as control:
        step(net, x, up)
    assert control.max_elements >= full
    handle = apply_tiled_mlp(net, num_shards=shards)
    xx = x.clone().requires_grad_()
    with AllocationTracker() as alloc:
        with SavedTensorTracker() as saved:
            out = net(xx)
        out.backward(up)
    assert alloc.max_elements <= full // shards, alloc.shapes_over(full // shards + 1)
    assert saved.shapes == [(batch, seq, hidden)] * 2, "only each module's input is saved"
    with torch.no_grad(), AllocationTracker() as no_grad:
        net(x)
    assert no_grad.max_elements <= full // shards
    handle.remove()


def test_automatic_shards_rule_and_untiled_when_one_shard():
    assert auto_num_shards(512 * 1024, 14336) == 28
    assert auto_num_shards(16384, 14336) == 1
    assert auto_num_shards(2**20, 4096) == 16
    net = Net()
    calls = []
    net.layers[0].mlp.gate_proj.register_forward_hook(lambda *a: calls.append(1))
    x, up = inputs(torch.float32)
    handle = apply_tiled_mlp(net)  # automatic: 2 x 37 x 256 elements is one shard
    step(net, x, up)
    assert len(calls) == 1, "one shard runs untiled: no recompute"
    handle.remove()
    calls.clear()
    handle = apply_tiled_mlp(net, num_shards=3)
    step(net, x, up)
    assert len(calls) == 6, "3 shards in forward, 3 recomputed in backward"
    handle.remove()


def test_errors_and_passthrough():
    net = Net()
    handle = apply_tiled_mlp(net, num_shards=2)
    with pytest.raises(ValueError, match="already tiled"):
        apply_tiled_mlp(net)
    handle.remove()
    with pytest.raises(ValueError, match="num_shards=0"):
        apply_tiled_mlp(net, num_shards=0)
    with pytest.raises(ValueError, match="no modules to tile"):
        apply_tiled_mlp(net, predicate=lambda n, m: False)

    class Pooling(nn.Module):
        def forward(self, x):
            return x.sum(dim=-2)

    pool_net = nn.Module()
    pool_net.pool = Pooling()
    handle = apply_tiled_mlp(pool_net, num_shards=2, predicate=lambda n, m: n == "pool")
    with pytest.raises(TypeError, match="token-wise"):
        pool_net.pool(torch.randn(2, 8, 4))
    handle.remove()
    handle = apply_tiled_mlp(net, num_shards=2)
    mlp = net.layers[0].mlp
    assert mlp(x=torch.randn(1, 4, 16)).shape == (1, 4, 16)  # keyword calls run untiled
    handle.remove()


def test_recompute_in_backward_runs_under_forward_autocast():
    """The shard recompute in backward runs in forward's autocast dtype: bf16 matmuls, not
    fp32 ones with twice the bytes."""
    net = Net(layers=2)
    mlp = net.layers[0].mlp
    dtypes = []
    mlp.gate_proj.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    handle = apply_tiled_mlp(net, num_shards=3)
    x, up = inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(x.requires_grad_())
    forward_dtypes = list(dtypes)
    out.backward(up.to(out.dtype))
    assert forward_dtypes == [torch.bfloat16] * 3
    assert dtypes[3:] == [torch.bfloat16] * 3, dtypes
    handle.remove()


class InPlace(nn.Module):
    """Scales its input in place, as Mixtral's router jitter does in training."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        x *= 1.5
        return self.proj(x)


def test_module_writing_its_input_in_place():
    torch.manual_seed(0)
    mod = InPlace().double()
    x, up = inputs(torch.float64)
    ref_in = x.clone().requires_grad_()
    ref_out = mod(ref_in * 1)  # the untiled module writes a non-leaf, as inside a model
    ref_out.backward(up)
    ref = {n: p.grad.clone() for n, p in mod.named_parameters()}
    mod.zero_grad(set_to_none=True)
    xt = x.clone().requires_grad_()
    src = xt * 1
    out = tiled_forward(mod.forward, src, 3, list(mod.parameters()))
    assert torch.equal(src, x), "the saved input is left as it came"
    out.backward(up)
    close(out.detach(), ref_out.detach(), TOL[torch.float64], "output")
    close(xt.grad, ref_in.grad, TOL[torch.float64], "input grad")
    for n, p in mod.named_parameters():
        close(p.grad, ref[n], TOL[torch.float64], n)


def test_batch_rows_shard_into_contiguous_views():
    """Modules that ``.view()`` their input take shards of any batch size."""

    class Viewing(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 8)

        def forward(self, x):
            b, s, h = x.shape
            return self.proj(x.view(-1, h)).view(b, s, -1)

    torch.manual_seed(0)
    mod = Viewing().double()
    x, _ = inputs(torch.float64, batch=3)
    up = torch.randn(3, 37, 8, dtype=torch.float64)
    ref_in = x.clone().requires_grad_()
    mod(ref_in).backward(up)
    ref = {n: p.grad.clone() for n, p in mod.named_parameters()}
    mod.zero_grad(set_to_none=True)
    xt = x.clone().requires_grad_()
    tiled_forward(mod.forward, xt, 4, list(mod.parameters())).backward(up)
    close(xt.grad, ref_in.grad, TOL[torch.float64], "input grad")
    for n, p in mod.named_parameters():
        close(p.grad, ref[n], TOL[torch.float64], n)
