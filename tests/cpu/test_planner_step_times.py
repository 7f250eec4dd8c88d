"""The planner's step time against measured H100 steps: each committed run's own measured rates
(attention kernel, layer linears with and without fused LoRA, PCIe, disk) given back to the
planner as it is now, the plan it makes compared with the one that ran, and its predicted step
within 10% of the measured one at 64K (full depth, with and without Liger's kernels), 256K and
the planner's longest (859,136 tokens). A change to the time model that moves a prediction off
the measurements fails here."""

import json
import os
import sys

import pytest

from offloadkit.kernels.options import KernelOptions
from offloadkit.longctx.options import LongContextOptions
from offloadkit.planning import Budgets, estimate_time, plan
from offloadkit.planning.memory import long_context_counts, long_context_options
from offloadkit.planning.timing import Rates

GiB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WITHIN = 0.10

# offload_plan: auto rows (benchmarks/capacity.py --probes auto:...): the plan is remade.
AUTO_ROWS = [
    "liger/h100-9bd14ab/rows/auto-65536-32L-eager.json",
    "liger/h100-9bd14ab/rows/auto-65536-32L-liger.json",
    "liger/h100-9bd14ab/rows/auto-262144-2L-liger.json",
]
# The planner's longest on an H100 (an ``everything`` probe at 3 layers, PEFT's LoRA path).
EDGE = "longctx/calibrated/h100-7b55b6a/edge-859136.json"


def _load(path: str) -> dict:
    with open(os.path.join(RESULTS, path)) as fh:
        return json.load(fh)


def _budgets(record: dict) -> Budgets:
    b = record["budgets"]
    rates = Rates(**{k: v for k, v in b["rates"].items() if k != "source"}, source="measured")
    return Budgets(
        gpu_bytes=int(b["gpu_gib"] * GiB), host_bytes=int(b["host_gib"] * GiB), disk_bytes=int(b["disk_gib"] * GiB),
        rates=rates,
    )  # fmt: skip


@pytest.mark.parametrize("path", AUTO_ROWS)
def test_auto_plans_step_is_within_ten_percent_of_the_measured_one(path):
    record = _load(path)
    (probe,) = record["probes"]
    config = probe["config"]
    kernels = (KernelOptions(rms_norm=True, glu_activation=True),) if config.get("liger_rms_norm") else ()
    p = plan(
        record["shape"], probe["seq_len"], lora_rank=record["lora_rank"], budgets=_budgets(record),
        layers=probe["layers"], fused_lora=config["fused_lora"], options=kernels,
    )  # fmt: skip
    # The plan made now is the one that ran, but for the 256K row's MLP: with Liger's backward
    # counted, leaving it untiled fits, and at equal times the plan takes coarser tiles (the
    # recompute skips a tiled MLP's forward: tiling costs no FLOPs here).
    assert p.placement == config["block_input_placement"]
    cfg = p.to_config()
    for key in ("keep_attention_outputs", "chunked_cross_entropy_num_chunks"):
        assert cfg.get(key) == config.get(key), key
    options, seconds = p.options, p.time.seconds
    ran = config.get("tiled_mlp_num_shards") or 1
    if (cfg.get("tiled_mlp_num_shards") or 1) != ran:
        assert probe["seq_len"] == 262144 and config.get("liger_glu_activation") and not cfg.get("tiled_mlp")
        long = next(o for o in options if isinstance(o, LongContextOptions))
        chunks, _, projections, groups = long_context_counts(long)
        tiled = long_context_options(chunks, ran, projections, groups)
        options = tuple(tiled if o is long else o for o in options)
        seconds = estimate_time(p.workload, options, p.budgets.rates, p.placement).seconds
        assert p.time.seconds <= seconds
    ratio = seconds / probe["step_s"]
    assert abs(ratio - 1) <= WITHIN, f"predicted {seconds:.2f} s, measured {probe['step_s']:.2f} s"


def test_the_longest_plans_step_is_within_ten_percent_of_the_measured_one():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import capacity  # noqa: E402

    record = _load(EDGE)
    (probe,) = record["probes"]
    budgets = _budgets(record)
    pred = capacity.predict(
        record["shape"], probe["mode"], probe["seq_len"], probe["layers"], record["lora_rank"], budgets.host_bytes,
        budgets=budgets,
    )  # fmt: skip
    assert pred["placement"] == probe["predicted"]["placement"], "the probe's plan, as it ran"
    ratio = pred["step_s"] / probe["step_s"]
    assert abs(ratio - 1) <= WITHIN, f"predicted {pred['step_s']:.1f} s, measured {probe['step_s']:.1f} s"
