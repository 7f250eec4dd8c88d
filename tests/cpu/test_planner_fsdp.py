"""The planner under FSDP2 (``Parallelism(shard_weights=True)``, ``offloadkit plan --fsdp``,
found by ``prepare()`` on a ``fully_shard``-ed model): a rank holds its share of the weights,
gradients and optimizer state, the root's weights and two gathered layers; the link carries the
all-gathers and reduce-scatters; the plan streams no weights and drops no block inputs."""

import dataclasses
import os
import sys

import pytest

from offloadkit.component import OptionSet
from offloadkit.layers.options import StreamingOptions
from offloadkit.optim.footprint import optimizer_footprint
from offloadkit.parallel.footprint import GATHERED_LAYERS, sharded_weights_footprint
from offloadkit.planning import Budgets, Parallelism, Plan, Workload, estimate_memory, plan, resolve_shape
from offloadkit.planning.plan import input_counts, option, place_inputs, planned_options
from offloadkit.planning.timing import Rates, estimate_time
from tests.torchrun import assert_ranks_reported, torchrun

GiB = 1 << 30
EIGHT_B = resolve_shape("llama-3-8b")


def _work(shards: int, **kw) -> Workload:
    parallel = Parallelism(4, ranks_per_host=4, shard_weights=shards > 1)
    return Workload(EIGHT_B, 32768, lora_rank=0, parallel=parallel, **kw)


def _offloaded(**chosen) -> OptionSet:
    """Block inputs offloaded to RAM (all but the last layer's) with the given choices: the
    same options at every workload here (8B, 32 layers)."""
    w = _work(1)
    return OptionSet(place_inputs(w, planned_options(w, offload_inputs=True, **chosen)))


def _streams_or_drops(p: Plan) -> bool:
    return option(p.options, StreamingOptions).enabled or bool(input_counts(p.workload, p.options)[1])


def test_a_rank_holds_its_shards_the_root_and_two_gathered_layers():
    s, b = EIGHT_B, 2
    f = _offloaded(loss_chunks=8)
    whole, sharded = estimate_memory(_work(1), f), estimate_memory(_work(4), f)
    root = (s.embed_params + s.head_params + s.hidden) * b
    layers = s.layers * s.layer_params * b
    assert whole.gpu_parts["weights"] == s.params * b
    assert sharded.gpu_parts["weights"] == layers // 4 + root + GATHERED_LAYERS * s.layer_params * b
    # Gradients and AdamW state: each rank's share, plus one layer's gradient before its reduce-scatter.
    assert sharded.gpu_parts["trainable state"] == -(-s.params // 4) * (b + 4) + s.layer_params * b
    assert whole.gpu_parts["trainable state"] == s.params * (b + 4)
    # Everything else (block inputs, the loss, a layer's backward) is the same.
    # Unsharded, the ranks are DDP's: its buckets hold a second copy of every gradient.
    assert whole.gpu_parts["DDP gradient buckets"] == s.params * b and "DDP gradient buckets" not in sharded.gpu_parts
    rest = {k for k in whole.gpu_parts if k not in ("weights", "trainable state", "DDP gradient buckets")}
    assert {k: whole.gpu_parts[k] for k in rest} == {k: sharded.gpu_parts[k] for k in rest}
    assert not sharded_weights_footprint(_work(1), f).gpu


def test_the_optimizer_state_in_host_memory_is_each_ranks_share():
    f = _offloaded(optimizer_offloading=True)
    for precision in ("params", "fp32_master", "compact"):
        whole = optimizer_footprint(_work(1, optimizer_precision=precision), f).host["optimizer state"]
        sharded = optimizer_footprint(_work(4, optimizer_precision=precision), f).host["optimizer state"]
        assert sharded == -(-EIGHT_B.params // 4) * (whole // EIGHT_B.params)


def test_the_link_carries_two_all_gathers_and_a_reduce_scatter():
    f = _offloaded(loss_chunks=8)
    w = _work(4)
    gathered = EIGHT_B.layers * EIGHT_B.layer_params * 2 * 3 // 4
    fast = estimate_time(w, f, Rates(), ["ram"] * 31 + ["gpu"])
    assert fast.shard_s == pytest.approx(3 * gathered / Rates().link_bytes_per_s)
    assert fast.bound != "shards"
    slow = estimate_time(w, f, Rates(link_bytes_per_s=1e9), ["ram"] * 31 + ["gpu"])
    assert slow.bound == "shards" and slow.seconds > fast.seconds
    assert estimate_time(_work(1), f, Rates(), ["ram"] * 31 + ["gpu"]).shard_s == 0
    # Ranks over several hosts all-gather over the network.
    hosts = dataclasses.replace(w, parallel=Parallelism(4, ranks_per_host=2, shard_weights=True))
    across = estimate_time(hosts, f, Rates(), ["ram"] * 31 + ["gpu"])
    assert across.shard_s == pytest.approx(3 * gathered / Rates().network_bytes_per_s)


def test_a_sharded_plan_streams_no_weights_and_drops_no_inputs():
    """A host too small for the block inputs: unsharded, the plan streams or drops; sharded, it
    does neither (FSDP2 refuses both) and says what does not fit instead."""
    budgets = Budgets(40 * GiB, 8 * GiB, 0)
    for lora in (16, 0):
        p = plan(
            "llama-3-8b",
            131072,
            lora_rank=lora,
            budgets=budgets,
            parallel=Parallelism(4, ranks_per_host=1, shard_weights=True),
        )
        assert not _streams_or_drops(p), p.name
        assert "layer_offloading" not in p.to_config() or not p.to_config()["layer_offloading"]
        assert "recompute_block_inputs" not in p.to_config()
    whole = plan("llama-3-8b", 131072, lora_rank=16, budgets=budgets, parallel=Parallelism(4, ranks_per_host=1))
    assert _streams_or_drops(whole)


def test_an_8b_full_fine_tune_fits_where_fsdp2_shards_it():
    budgets = Budgets(79 * GiB, 100 * GiB, 100 * GiB)
    kw = dict(lora_rank=0, budgets=budgets)
    whole = plan("llama-3-8b", 65536, parallel=Parallelism(4, ranks_per_host=4), **kw)
    sharded = plan("llama-3-8b", 65536, parallel=Parallelism(4, ranks_per_host=4, shard_weights=True), **kw)
    assert sharded.fits and sharded.memory.gpu_peak < 0.6 * whole.memory.gpu_peak


def test_the_options_are_checked(capsys):
    from offloadkit.cli.main import main

    with pytest.raises(ValueError, match="shard_weights='yes' is invalid"):
        Parallelism(2, shard_weights="yes")
    assert main(["plan", "--shape", "llama-3-8b", "--seq-len", "8192", "--fsdp"]) != 0
    assert "--fsdp shards the weights over the ranks" in capsys.readouterr().err
    argv = ["plan", "--shape", "llama-3-8b", "--seq-len", "8192", "--lora-rank", "0", "--world-size", "2"]
    assert main([*argv, "--no-context-parallel", "--fsdp", "--gpu-gib", "79", "--host-gib", "50"]) == 0
    assert "weights sharded over 2 (FSDP2)" in capsys.readouterr().out


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")
def test_a_fully_sharded_models_shards_are_what_the_planner_holds_and_prepare_plans_them():
    worker = os.path.join(os.path.dirname(__file__), "dist", "fsdp_plan_worker.py")
    assert_ranks_reported(torchrun(worker), ["shards", "prepare", "ddp", "fused"])


def test_ddp_buckets_hold_every_gradient_beside_what_the_optimizer_holds():
    """DDP's all-reduce buckets hold every trainable gradient for the model's life: a second
    copy by default; with ``gradient_as_bucket_view`` the gradients themselves, which updates in
    backward then cannot free."""
    s, b = EIGHT_B, 2
    f = _offloaded(loss_chunks=8)
    offloaded = _offloaded(loss_chunks=8, optimizer_offloading=True)

    def held(fp):  # held all step, or (updated in backward) while the layers run backward
        return {**fp.gpu, **fp.layer}

    def parts(options, **parallel):
        w = Workload(EIGHT_B, 32768, lora_rank=0, updates_in_backward=True, parallel=Parallelism(2, **parallel))
        return held(optimizer_footprint(w, options))

    one = held(optimizer_footprint(Workload(EIGHT_B, 32768, lora_rank=0, updates_in_backward=True), offloaded))
    ddp, view = parts(offloaded), parts(offloaded, bucket_view=True)
    assert "DDP gradient buckets" not in one
    assert ddp["DDP gradient buckets"] == view["DDP gradient buckets"] == s.params * b
    # The one gradient in flight of an update in backward is, with bucket views, inside a bucket.
    largest = max(max(x * y for x, y in s.linears), s.embed_params, s.head_params)
    assert ddp["trainable state"] - view["trainable state"] == largest * b
    assert ddp["trainable state"] == one["trainable state"]
    plain, plain_view = parts(f), parts(f, bucket_view=True)
    assert plain["trainable state"] - plain_view["trainable state"] == s.params * b
    lora = Workload(EIGHT_B, 32768, lora_rank=16, parallel=Parallelism(2))
    assert optimizer_footprint(lora, f).gpu["DDP gradient buckets"] == s.lora_params(16) * 4
    # Context parallelism all-reduces each gradient itself: no buckets.
    cp = Workload(EIGHT_B, 32768, lora_rank=0, parallel=Parallelism(2, context_parallel=True))
    assert "DDP gradient buckets" not in optimizer_footprint(cp, f).gpu


def test_the_physical_limit_under_fsdp2_neither_streams_nor_replays():
    """With RAM too small for the block inputs, a run that may drop inputs and stream weights
    is physically allowed far longer sequences than one under FSDP2, which may do neither: the
    limit under FSDP2 is what fits with every input kept and the shards on the GPU."""
    from offloadkit.planning import longest_sequence, physical_limit

    budgets = Budgets(40 * GiB, 4 * GiB, 0)
    sharded = Parallelism(4, ranks_per_host=1, shard_weights=True)
    limit, why = physical_limit("llama-3-8b", lora_rank=16, budgets=budgets, parallel=sharded)
    free, _ = physical_limit("llama-3-8b", lora_rank=16, budgets=budgets, parallel=Parallelism(4, ranks_per_host=1))
    assert why == "storage" and limit < free
    cap = longest_sequence("llama-3-8b", lora_rank=16, budgets=budgets, parallel=sharded)
    assert cap.plan is not None and not _streams_or_drops(cap.plan)
    assert cap.longest <= limit
