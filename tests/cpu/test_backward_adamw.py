"""BackwardAdamW against torch.optim.AdamW on the same model and data: every update bitwise
equal (fp32 and bf16 parameters, two parameter groups, weight decay, a learning-rate
schedule, gradient clipping, gradient accumulation, a state_dict round trip, a parameter
used in two reentrant checkpoints, tied weights), gradients gone after backward, moments on
the host."""

import copy
import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from offloadkit.optim import BackwardAdamW
from offloadkit.testing import Fp32MasterAdamW, assert_bitwise_equal


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to(dtype)


def _groups(model, lr):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": lr * 2}]


def _batches(dtype, n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g).to(dtype), torch.randn(16, 8, generator=g).to(dtype)) for _ in range(n)]


def _loss(model, batch):
    x, y = batch
    return (model(x) - y).float().square().mean()


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# Each of PyTorch's AdamW implementations rounds its own way: matched one for one.
KERNELS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_every_update_bitwise_equal_to_torch_adamw(dtype, clip, kernel):
    ref, ours = _model(dtype), _model(dtype)
    ours.load_state_dict(ref.state_dict())
    kw = KERNELS[kernel]
    opt_ref = torch.optim.AdamW(_groups(ref, 1e-2), lr=1e-2, betas=(0.8, 0.95), eps=1e-6, **kw)
    opt = BackwardAdamW(_groups(ours, 1e-2), lr=1e-2, betas=(0.8, 0.95), eps=1e-6, max_grad_norm=clip, **kw)
    sched_ref = torch.optim.lr_scheduler.LambdaLR(opt_ref, lambda s: 1.0 / (1 + s))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for step, batch in enumerate(_batches(dtype, 5)):
        _loss(ref, batch).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt_ref.step()
        opt_ref.zero_grad()
        sched_ref.step()
        _loss(ours, batch).backward()
        if clip is None:
            # Updated in backward: no gradient is left to hold memory.
            assert all(p.grad is None for p in ours.parameters())
        opt.step()
        opt.zero_grad()
        sched.step()
        assert_bitwise_equal(_params(ref), _params(ours), f"step {step}")
    state = opt.state[next(ours.parameters())]
    assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].dtype == dtype


def test_gradient_accumulation_updates_once_per_step():
    ref, ours = _model(torch.float32), _model(torch.float32)
    ours.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = BackwardAdamW(ours.parameters(), lr=1e-2)
    batches = _batches(torch.float32, 6)
    for i in range(0, 6, 3):
        for b in batches[i : i + 3]:
            (_loss(ref, b) / 3).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        with opt.accumulating():
            for b in batches[i : i + 2]:
                (_loss(ours, b) / 3).backward()
        assert all(p.grad is not None for p in ours.parameters())  # accumulated, not applied
        (_loss(ours, batches[i + 2]) / 3).backward()  # the last micro-step updates
        opt.step()
        opt.zero_grad()
        assert_bitwise_equal(_params(ref), _params(ours), f"step {i // 3}")


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_state_dict_round_trip_continues_bitwise(kernel):
    ref, ours = _model(torch.float32), _model(torch.float32)
    ours.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, **KERNELS[kernel])
    opt = BackwardAdamW(ours.parameters(), lr=1e-2, **KERNELS[kernel])
    batches = _batches(torch.float32, 4)
    for b in batches[:2]:
        _loss(ref, b).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        _loss(ours, b).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"][0]["step"].item() == 2.0
    opt.remove()
    resumed = BackwardAdamW(ours.parameters(), lr=1e-2, **KERNELS[kernel])
    resumed.load_state_dict(saved)
    for b in batches[2:]:
        _loss(ref, b).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        _loss(ours, b).backward()
        resumed.step()
    assert_bitwise_equal(_params(ref), _params(ours), "after resuming")


def test_arguments_are_checked():
    model = _model(torch.float32)
    with pytest.raises(ValueError, match="max_grad_norm=0 is invalid"):
        BackwardAdamW(model.parameters(), max_grad_norm=0)
    with pytest.raises(ValueError, match="lr=-1 is invalid"):
        BackwardAdamW(model.parameters(), lr=-1)
    with pytest.raises(ValueError, match="pick one AdamW implementation"):
        BackwardAdamW(model.parameters(), foreach=True, fused=True)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_fp32_master_weights_bitwise_equal_to_adamw_over_fp32_copies(kernel):
    ref, ours = _model(torch.bfloat16), _model(torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    opt_ref = Fp32MasterAdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, **KERNELS[kernel])
    opt = BackwardAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True, **KERNELS[kernel])
    batches = _batches(torch.bfloat16, 6)
    for step, batch in enumerate(batches[:3]):
        _loss(ref, batch).backward()
        opt_ref.step()
        _loss(ours, batch).backward()
        opt.step()
        assert_bitwise_equal(_params(ref), _params(ours), f"step {step}")
    state = opt.state[next(ours.parameters())]
    assert state["master"].dtype == torch.float32 and state["exp_avg"].dtype == torch.float32
    master = dict(zip([n for n, _ in ref.named_parameters()], opt_ref.param_groups[0]["params"]))
    ours_master = {n: opt.state[p]["master"] for n, p in ours.named_parameters()}
    assert_bitwise_equal({n: m.detach() for n, m in master.items()}, ours_master, "master weights")
    # A checkpoint keeps the fp32 state (PyTorch's loader would round it to bf16).
    saved = copy.deepcopy(opt.state_dict())
    opt.remove()
    resumed = BackwardAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True, **KERNELS[kernel])
    resumed.load_state_dict(saved)
    assert resumed.state[next(ours.parameters())]["master"].dtype == torch.float32
    for step, batch in enumerate(batches[3:]):
        _loss(ref, batch).backward()
        opt_ref.step()
        _loss(ours, batch).backward()
        resumed.step()
        assert_bitwise_equal(_params(ref), _params(ours), f"step {step + 3} after resuming")


def test_fp32_parameters_need_no_master_copy():
    model = _model(torch.float32)
    opt = BackwardAdamW(model.parameters(), lr=1e-2, master_weights=True)
    _loss(model, _batches(torch.float32, 1)[0]).backward()
    assert "master" not in opt.state[next(model.parameters())]


def test_a_torch_adamw_checkpoint_loads_and_continues_bitwise():
    """A checkpoint of torch.optim.AdamW (groups without BackwardAdamW's own keys) loads into
    host memory and the training continues as torch.optim.AdamW's own would."""
    ref, ours = _model(torch.float32), _model(torch.float32)
    ours.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = _batches(torch.float32, 4)
    for b in batches[:2]:
        _loss(ref, b).backward()
        opt_ref.step()
        opt_ref.zero_grad()
    ours.load_state_dict(ref.state_dict())
    opt = BackwardAdamW(ours.parameters(), lr=1e-2)
    opt.load_state_dict(copy.deepcopy(opt_ref.state_dict()))
    assert opt.param_groups[0]["master_weights"] is False  # filled from the defaults
    for b in batches[2:]:
        _loss(ref, b).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        _loss(ours, b).backward()
        opt.step()
    assert_bitwise_equal(_params(ref), _params(ours), "after loading torch's checkpoint")
    state = opt.state[next(ours.parameters())]
    assert state["exp_avg"].device.type == "cpu" and state["step"].item() == 4.0


@pytest.mark.parametrize("precision", ["params", "fp32_master"])
def test_state_in_memory_mapped_files_is_bitwise_the_same_and_leaves_no_file(tmp_path, precision):
    """``state_dir``: the state rests in files mapped into memory (paged to disk past RAM),
    unlinked at once; the updates and a checkpoint round trip are exactly those of host memory."""
    ref, ours = _model(torch.bfloat16), _model(torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    opt_ref = BackwardAdamW.for_precision(ref.parameters(), precision, lr=1e-2)
    opt = BackwardAdamW.for_precision(ours.parameters(), precision, lr=1e-2, state_dir=str(tmp_path / "state"))
    for batch in _batches(torch.bfloat16, 3):
        _loss(ref, batch).backward()
        opt_ref.step()
        _loss(ours, batch).backward()
        opt.step()
    assert_bitwise_equal(_params(ref), _params(ours), "weights")
    assert os.listdir(tmp_path / "state") == [], "the files are unlinked once mapped"
    state = opt.state[next(ours.parameters())]
    assert not state["exp_avg"].is_pinned() and state["exp_avg"].untyped_storage().filename is not None
    again = BackwardAdamW.for_precision(ours.parameters(), precision, lr=1e-2, state_dir=str(tmp_path / "state"))
    again.load_state_dict(opt.state_dict())
    assert_bitwise_equal(
        {k: v for k, v in opt.state[next(ours.parameters())].items() if k != "step"},
        {k: v for k, v in again.state[next(ours.parameters())].items() if k != "step"},
        "state after a round trip",
    )
    again.remove()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="state_dir=.*cannot hold the optimizer's state"):
        BackwardAdamW(ours.parameters(), state_dir=str(tmp_path / "a-file" / "state"))


def test_two_optimizers_sharing_a_state_dir_never_share_a_file(tmp_path):
    a, b = _model(torch.float32), _model(torch.float32)
    opt_a = BackwardAdamW(a.parameters(), lr=1e-2, state_dir=str(tmp_path))
    opt_b = BackwardAdamW(b.parameters(), lr=1e-3, state_dir=str(tmp_path))
    batch = _batches(torch.float32, 1)[0]
    for model, opt in ((a, opt_a), (b, opt_b)):
        _loss(model, batch).backward()
        opt.step()
    pa, pb = next(a.parameters()), next(b.parameters())
    assert opt_a.state[pa]["exp_avg"].data_ptr() != opt_b.state[pb]["exp_avg"].data_ptr()
    assert not torch.equal(opt_a.state[pa]["exp_avg_sq"], torch.zeros_like(pa))
    assert os.listdir(tmp_path) == []


class SharedSegments(nn.Module):
    """One block applied in two reentrant checkpoints: each segment's backward is a backward
    of its own, and the block's gradient arrives in two pieces. With ``outside`` the block is
    also applied once more outside the checkpoints."""

    def __init__(self, outside: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.out = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        self.outside = outside

    def _segment(self, h):
        return nn.functional.gelu(self.block(h))

    def forward(self, x):
        h = self.inp(x)
        for _ in range(2):
            h = checkpoint(self._segment, h, use_reentrant=True)
        return self.out(self.block(h) if self.outside else h)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_parameter_in_two_reentrant_checkpoints_is_updated_once_with_its_whole_gradient(kernel):
    ref, ours = SharedSegments(), SharedSegments()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, **KERNELS[kernel])
    opt = BackwardAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, **KERNELS[kernel])
    for step, batch in enumerate(_batches(torch.float32, 3)):
        _loss(ref, batch).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        _loss(ours, batch).backward()
        # Outside the checkpoints each parameter is updated (and its gradient freed) in
        # backward; the block's update waits for step(), with both pieces of its gradient.
        assert all(p.grad is None for m in (ours.inp, ours.out) for p in m.parameters())
        assert all(p.grad is not None for p in ours.block.parameters())
        opt.step()
        assert all(p.grad is None for p in ours.parameters())
        assert_bitwise_equal(_params(ref), _params(ours), f"step {step}")


def test_a_parameter_updated_before_a_reentrant_checkpoint_uses_it_is_refused():
    """Used outside the checkpoints too, the block's last gradient there comes first: it was
    updated before the checkpoints' pieces arrived, which must not pass silently."""
    model = SharedSegments(outside=True)
    BackwardAdamW(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match=r"a \[64(, 64)?\] parameter was updated.*use_reentrant=False"):
        _loss(model, _batches(torch.float32, 1)[0]).backward()


class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mid, self.head = nn.Embedding(48, 32), nn.Linear(32, 32), nn.Linear(32, 48, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_tied_embedding_and_head_are_updated_once_in_backward(kernel):
    """Both uses of a tied weight meet in one gradient accumulation: one update, in backward."""
    ref, ours = TiedHead(), TiedHead()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, **KERNELS[kernel])
    opt = BackwardAdamW(ours.parameters(), lr=1e-2, **KERNELS[kernel])
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        ids = torch.randint(0, 48, (4, 12), generator=g)
        for model in (ref, ours):
            logits = model(ids[:, :-1])
            nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        assert all(p.grad is None for p in ours.parameters()), "updated and freed in backward"
        opt_ref.step()
        opt_ref.zero_grad()
        opt.step()
        assert_bitwise_equal(_params(ref), _params(ours), f"step {step}")
