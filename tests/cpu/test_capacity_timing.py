"""The timing loop of ``benchmarks/capacity.py`` (and of the Axolotl stack's rows): warm-up
steps untimed, the median of the timed ones, the last step handed to a profiler untimed, the
process's peak RSS over it all."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import capacity  # noqa: E402


def test_warmup_is_untimed_and_the_median_of_the_timed_steps_is_the_step():
    calls, hooks = [], []

    def step():
        calls.append(len(calls))
        return float(len(calls))

    out = {}
    capacity.time_steps(step, 2, 3, out, after_warmup=lambda: hooks.append(len(calls)), cuda=False)
    assert calls == [0, 1, 2, 3, 4] and hooks == [2]  # the hook between warm-up and timing
    assert len(out["step_times_s"]) == 3 and round(out["step_s"], 3) == sorted(out["step_times_s"])[1]
    assert out["loss"] == 5.0 and out["host_rss_gib"] > 0
    assert "peak_allocated_gib" not in out  # no GPU: no GPU figures


def test_the_last_step_goes_to_its_handler_and_is_not_timed():
    handled = []
    out = {}
    capacity.time_steps(lambda: 1.0, 0, 3, out, last=lambda step: handled.append(step()), cuda=False)
    assert handled == [1.0] and len(out["step_times_s"]) == 2


def test_the_gradient_norm_is_read_without_touching_the_gradients():
    import torch

    a, b, c = torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True), torch.zeros(1)
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0])
    before = [a.grad.clone(), b.grad.clone()]
    assert capacity.grad_norm([a, b, c]) == 5.0
    assert torch.equal(a.grad, before[0]) and torch.equal(b.grad, before[1])
    assert capacity.grad_norm([c]) is None  # updated in backward: nothing left to read


def test_gpu_gib_caps_the_plans_budget(capsys):
    """--gpu-gib (an H100's memory on a larger card) is the budget the parent plans with."""
    assert capacity.main(["--budgets-only", "--gpu-gib", "79", "--host-budget-gib", "8"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("BUDGETS ")][-1]
    budgets = json.loads(line[len("BUDGETS ") :])
    assert budgets["gpu"] == 79 << 30
    assert budgets["host"] == 8 << 30
