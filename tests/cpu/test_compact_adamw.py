"""The compact optimizer state (``stochastic_rounding=True``, ``optimizer_precision: compact``):
stochastic rounding is unbiased and lands on a bf16 neighbour; each compact update is the fp32
AdamW update rounded to one of its two bf16 neighbours (chunked or not); where pure bf16 loses
every update to rounding, the compact state keeps them on average, as fp32 master weights do."""

import copy

import pytest
import torch
from torch import nn

from offloadkit.optim import BackwardAdamW, stochastic_round_to_bf16


def _neighbours(x32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above each fp32 value in magnitude (truncate, and one up)."""
    bits = x32.view(torch.int32)
    down = (bits & -65536).view(torch.float32)
    up = ((bits & -65536) + 65536).view(torch.float32)
    return down, up


def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=g) * torch.logspace(-20, 20, 64)
    x[::7] = x[::7].bfloat16().float()  # some values bf16 holds exactly: never moved
    samples = torch.stack([stochastic_round_to_bf16(x, g).float() for _ in range(4000)])
    down, up = _neighbours(x)
    assert ((samples == down) | (samples == up)).all()
    exact = x.bfloat16().float() == x
    assert (samples[:, exact] == x[exact]).all()
    # The mean lands on x: the error, in units of the gap, shrinks as 1/sqrt(n).
    gap = (up - down).abs()
    err = ((samples.double().mean(0) - x.double()).abs() / gap.double())[~exact]
    assert err.max() < 0.05, err.max()
    # Rounding to nearest would be biased: x = 1 + a quarter step rounds up a quarter of the time.
    quarter = torch.full((100_000,), 1.0 + 2.0**-9)
    assert abs(stochastic_round_to_bf16(quarter, g).float().mean().item() - (1.0 + 2.0**-9)) < 2e-4


def test_stochastic_rounding_keeps_signs_and_non_finite_values():
    g = torch.Generator().manual_seed(1)
    x = torch.tensor([-1.0 - 2.0**-10, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 3.4e38])
    y = stochastic_round_to_bf16(x, g).float()
    assert y[0] in (-1.0, -1.0 - 2.0**-7)
    assert y[1] == float("inf") and y[2] == float("-inf") and torch.isnan(y[3])
    assert y[4] == 0.0 and torch.signbit(y[5])
    assert y[6] > 3.3e38  # the largest values round to bf16's largest or to infinity
    with pytest.raises(ValueError, match="takes fp32, not torch.bfloat16"):
        stochastic_round_to_bf16(x.bfloat16())


@pytest.mark.parametrize("chunk", [1 << 24, 7])
def test_each_compact_update_is_the_fp32_update_rounded_to_a_neighbour(chunk):
    """Three steps on a bf16 layer; before each, torch.optim.AdamW over fp32 copies of the
    compact state (weights and moments widened) gives the fp32 update, and the compact result
    is one of its bf16 neighbours, element by element. Chunks of 7 elements update with the
    same step count (the bias correction) as one chunk."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 48).bfloat16()
    opt = BackwardAdamW(layer.parameters(), lr=1e-2, weight_decay=0.1, stochastic_rounding=True, chunk_elements=chunk)
    x = torch.randn(16, 32).bfloat16()
    for step in range(3):
        ref_params = [nn.Parameter(p.detach().float()) for p in layer.parameters()]
        ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
        loss = layer(x).float().square().mean()
        grads = torch.autograd.grad(loss, list(layer.parameters()), retain_graph=True)
        for rp, p, g in zip(ref_params, layer.parameters(), grads):
            rp.grad = g.float()
            if step:
                s = opt.state[p]
                ref.state[rp] = {
                    "step": s["step"].clone(),
                    "exp_avg": s["exp_avg"].float(),
                    "exp_avg_sq": s["exp_avg_sq"].float(),
                }
        ref.step()
        loss.backward()  # the compact update happens here, parameter by parameter
        opt.step()
        for rp, p in zip(ref_params, layer.parameters()):
            down, up = _neighbours(rp.detach())
            got = p.detach().float()
            assert ((got == down) | (got == up)).all(), f"step {step}"
            s, rs = opt.state[p], ref.state[rp]
            assert s["step"].item() == step + 1 and s["exp_avg"].dtype == torch.bfloat16
            for key in ("exp_avg", "exp_avg_sq"):
                down, up = _neighbours(rs[key])
                got = s[key].float()
                assert ((got == down) | (got == up)).all(), (key, step)


def test_a_strided_parameter_is_updated_in_chunks_of_rows():
    """A transposed (non-contiguous) parameter, chunked by rows: each weight lands on a bf16
    neighbour of the fp32 update, as for a contiguous one."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(24, 40).bfloat16().t())  # [40, 24], strided
    assert not w.is_contiguous()
    ref = nn.Parameter(w.detach().float())
    grad = torch.randn(40, 24)
    opt = BackwardAdamW([w], lr=1e-2, stochastic_rounding=True, chunk_elements=100)  # 4 rows a chunk
    w.grad = grad.bfloat16().t().contiguous().t()  # strided like the parameter
    ref.grad = w.grad.float()
    opt.step()
    torch.optim.AdamW([ref], lr=1e-2).step()
    down, up = _neighbours(ref.detach().contiguous())
    got = w.detach().float()
    assert ((got == down) | (got == up)).all() and opt.state[w]["step"].item() == 1.0


def test_small_updates_survive_as_with_fp32_master_weights_and_vanish_in_pure_bf16():
    """Weights at 1.0 moved by AdamW steps of about 1e-4, 30 times smaller than bf16's half
    step there: pure bf16 rounds every update away, fp32 master weights move 100 steps' worth,
    and the compact state moves as far on average."""
    moved = {}
    precisions = {"params": {}, "fp32_master": {"master_weights": True}, "compact": {"stochastic_rounding": True}}
    for name, kw in precisions.items():
        w = nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = BackwardAdamW([w], lr=1e-4, weight_decay=0.0, **kw)
        for _ in range(100):
            (w.float() * 0.5).sum().backward()  # a constant gradient: each step moves about lr
            opt.step()
        # fp32 master weights: the master copy (the bf16 weight is it rounded to nearest).
        kept = opt.state[w]["master"] if name == "fp32_master" else w.detach()
        moved[name] = (1.0 - kept.double()).mean().item()
    assert moved["params"] == 0.0
    assert moved["fp32_master"] == pytest.approx(100e-4, rel=0.01)
    assert moved["compact"] == pytest.approx(moved["fp32_master"], rel=0.05)


def test_compact_state_is_bf16_host_memory_and_survives_a_checkpoint():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))  # fp32 parameters: bf16 moments all the same
    opt = BackwardAdamW(model.parameters(), lr=1e-2, stochastic_rounding=True, seed=3)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    for p in model.parameters():
        state = opt.state[p]
        assert "master" not in state and state["exp_avg"].dtype == torch.bfloat16
        assert state["exp_avg_sq"].dtype == torch.bfloat16 and state["exp_avg"].device.type == "cpu"
    saved = copy.deepcopy(opt.state_dict())
    opt.remove()
    resumed = BackwardAdamW(model.parameters(), lr=1e-2, stochastic_rounding=True, seed=3)
    resumed.load_state_dict(saved)
    for p in model.parameters():
        assert resumed.state[p]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(resumed.state[p]["exp_avg"], opt.state[p]["exp_avg"])


def test_the_same_seed_gives_the_same_run_and_a_checkpoint_resumes_it_exactly():
    def run(resume_at=None):
        w = nn.Parameter(torch.linspace(-1, 1, 257, dtype=torch.bfloat16))
        opt = BackwardAdamW([w], lr=1e-3, stochastic_rounding=True, seed=11)
        for step in range(4):
            if step == resume_at:
                saved = copy.deepcopy(opt.state_dict())
                opt.remove()
                opt = BackwardAdamW([w], lr=1e-3, stochastic_rounding=True, seed=99)  # the seed comes back
                opt.load_state_dict(saved)
            (w.float() ** 3).sum().backward()
            opt.step()
        return w.detach().clone()

    first = run()
    assert torch.equal(first, run())
    assert torch.equal(first, run(resume_at=2))


def test_a_precision_name_gives_its_options():
    p = [nn.Parameter(torch.ones(2))]
    assert BackwardAdamW.for_precision(p, "fp32_master").defaults["master_weights"]
    compact = BackwardAdamW.for_precision(p, "compact", lr=0.5)
    assert compact.defaults["stochastic_rounding"] and compact.defaults["lr"] == 0.5
    plain = BackwardAdamW.for_precision(p)
    assert not plain.defaults["master_weights"] and not plain.defaults["stochastic_rounding"]
    with pytest.raises(ValueError, match="precision='fp8' is not an optimizer precision"):
        BackwardAdamW.for_precision(p, "fp8")


def test_compact_and_master_weights_are_exclusive():
    with pytest.raises(ValueError, match="pick fp32 master state"):
        BackwardAdamW([nn.Parameter(torch.ones(2))], master_weights=True, stochastic_rounding=True)
    with pytest.raises(ValueError, match="chunk_elements=0 must be >= 1"):
        BackwardAdamW([nn.Parameter(torch.ones(2))], stochastic_rounding=True, chunk_elements=0)


def _trained(opt_kwargs, steps=2):
    torch.manual_seed(0)
    layer = nn.Linear(8, 8).bfloat16()
    opt = BackwardAdamW(layer.parameters(), lr=1e-2, **opt_kwargs)
    for _ in range(steps):
        layer(torch.ones(2, 8, dtype=torch.bfloat16)).float().square().sum().backward()
        opt.step()
    return layer, opt


@pytest.mark.parametrize(
    "saved_kwargs, now_kwargs",
    [
        ({}, {"master_weights": True}),
        ({"master_weights": True}, {"stochastic_rounding": True}),
        ({"stochastic_rounding": True}, {}),
        ({"master_weights": True}, {}),
    ],
    ids=["params->fp32_master", "fp32_master->compact", "compact->params", "fp32_master->params"],
)
def test_a_checkpoint_of_another_precision_is_converted_to_the_one_asked_for(saved_kwargs, now_kwargs):
    """The precision given to the constructor wins over the checkpoint's; the state is
    converted (a master copy made from the parameter, or dropped; moments cast) and training
    goes on."""
    layer, opt = _trained(saved_kwargs)
    saved = copy.deepcopy(opt.state_dict())
    opt.remove()
    resumed = BackwardAdamW(layer.parameters(), lr=1e-2, **now_kwargs)
    resumed.load_state_dict(saved)
    group = resumed.param_groups[0]
    assert group["master_weights"] == bool(now_kwargs.get("master_weights"))
    assert group["stochastic_rounding"] == bool(now_kwargs.get("stochastic_rounding"))
    state = resumed.state[layer.weight]
    if now_kwargs.get("master_weights"):
        assert state["exp_avg"].dtype == torch.float32
        if not saved_kwargs.get("master_weights"):
            assert torch.equal(state["master"], layer.weight.detach().float())  # made from the parameter
    else:
        assert "master" not in state and state["exp_avg"].dtype == torch.bfloat16
    assert state["step"].item() == 2.0
    before = layer.weight.detach().clone()
    layer(torch.ones(2, 8, dtype=torch.bfloat16)).float().square().sum().backward()
    resumed.step()
    assert not torch.equal(before, layer.weight.detach()) and torch.isfinite(layer.weight).all()


def test_the_rounding_state_is_saved_by_device_type_and_restored_onto_the_cpu():
    """Saved by device type (every DDP rank seeds and draws alike; the rank that saves speaks
    for all), restored into the generator of each parameter's device, created before or after
    loading; a checkpoint naming a device ("cpu:0"-style keys of older saves) loads too."""
    _, opt = _trained({"stochastic_rounding": True, "seed": 4})
    saved = opt.state_dict()
    assert set(saved["stochastic_rounding_rng"]) == {"cpu"}
    expected = saved["stochastic_rounding_rng"]["cpu"]
    for key in ("cpu", "cpu:0"):
        layer, fresh = _trained({"stochastic_rounding": True, "seed": 99}, steps=0)
        legacy = dict(copy.deepcopy(saved), stochastic_rounding_rng={key: expected.clone()})
        fresh.load_state_dict(legacy)
        assert torch.equal(fresh._generator(torch.device("cpu")).get_state(), expected)
