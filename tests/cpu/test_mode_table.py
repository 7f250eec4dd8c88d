"""The one mode table (``offloadkit/bench/modes.py``): ``offloadkit bench`` and
``benchmarks/capacity.py`` name the same setups the same way, the config-route modes build
configs ``prepare()`` accepts, and each harness says where a mode it cannot run does run."""

import os
import sys

import pytest

from offloadkit.bench.harness import BenchConfig, run_benchmark
from offloadkit.bench.modes import MODES, PROBE_MODES
from offloadkit.compose import prepare
from offloadkit.config import OffloadConfig
from offloadkit.testing import build_llama

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import capacity  # noqa: E402

PREDICTED = {"loss_chunks": 4, "mlp_shards": 2, "placement": "rdxg", "horizon": None, "tiled_projections": True}


def test_every_probe_mode_is_in_the_one_table():
    assert set(PROBE_MODES) <= set(MODES)
    assert not hasattr(capacity, "MODES") or capacity.MODES is MODES  # no second table
    groups = capacity._parse("hf_ckpt:16384:32:1:2;everything:8192:2|in_gpu:8192:2", 1, 1)
    assert [[a["mode"] for a in g] for g in groups] == [["ckpt"], ["everything", "in_gpu"]]
    with pytest.raises(SystemExit, match="mode in"):
        capacity._parse("offload:1024:2", 1, 1)  # an in-process bench mode, not a probe mode


def test_the_config_route_modes_build_configs_prepare_accepts():
    probe = {"predicted": PREDICTED, "host_budget": 1 << 30, "disk_dir": "/tmp/x", "seq_len": 4096}
    everything = OffloadConfig.from_dict(MODES["everything"].config(probe))
    assert everything.recompute_block_inputs == (2,)  # the "x" of the placement code
    assert everything.activation_loading_horizon == 4  # some inputs come from disk
    assert everything.tiled_mlp_num_shards == 2 and everything.chunked_cross_entropy_num_chunks == 4
    assert everything.layer_offloading and everything.disk_dir == "/tmp/x"
    in_gpu = OffloadConfig.from_dict(MODES["in_gpu"].config(probe))
    assert not in_gpu.activation_offloading and in_gpu.tiled_mlp and in_gpu.gradient_checkpointing
    assert MODES["auto"].config(probe) == {"offload_plan": "auto", "seq_len": 4096, "host_budget_bytes": 1 << 30}
    model = build_llama("tiny")
    runtime = prepare(model, MODES["in_gpu"].config(dict(probe, predicted=dict(PREDICTED, mlp_shards=1))))
    assert runtime.checkpointing is not None and runtime.chunked_loss is not None and runtime.manager is None
    runtime.close()


def test_the_bench_skips_a_config_route_mode_naming_where_it_runs():
    cfg = BenchConfig(shape="tiny", seq_len=64, batch=1, modes=["none", "everything"], device="cpu", steps=1, warmup=0)
    report = run_benchmark(cfg, log=lambda _: None)
    rows = {r["mode"]: r for r in report["results"]}
    assert rows["none"]["status"] == "ok"
    assert rows["everything"]["status"] == "skipped" and "benchmarks/capacity.py" in rows["everything"]["note"]


def test_a_reduced_depth_probe_reports_the_planners_full_depth_footprint():
    """A 3-layer edge probe stands for the planner's full-depth run, whose block inputs fit the
    disk because some are replayed: its full-depth figures are that plan's, not those of every
    input stored."""
    from offloadkit.planning import Budgets, plan

    gib = 1 << 30
    budgets = Budgets(80 * gib, 108 * gib, 55 * gib)
    seq = 880640  # the longest on these budgets (test_planning)
    full = capacity.full_depth("llama-3-8b", "everything", seq, 3, 16, 108 * gib, budgets)
    p = plan("llama-3-8b", seq, lora_rank=16, budgets=budgets)
    assert "x" in full["placement"] and full["disk_gib"] <= 55
    assert full["disk_gib"] == p.memory.disk / gib and full["host_gib"] == p.memory.host / gib
    whole = capacity.full_depth("llama-3-8b", "everything", 65536, 32, 16, 108 * gib, budgets)
    assert whole == capacity.predict("llama-3-8b", "everything", 65536, 32, 16, 108 * gib, budgets)
