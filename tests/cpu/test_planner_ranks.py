"""The planner over several GPUs: one rank's plan of a sequence split over the ranks (context
parallelism), the host's RAM and disk shared by its ranks, ring attention's traffic and
buffers, ``offloadkit plan --world-size`` and ``offload_plan: auto`` under a launcher."""

import os
import re
import shutil
import subprocess
import sys
from collections import namedtuple
from dataclasses import fields, replace

import pytest

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.planning import (
    Budgets,
    Workload,
    estimate_memory,
    estimate_time,
    longest_sequence,
    plan,
    resolve_shape,
)
from offloadkit.planning.memory import HOST_BASELINE_BYTES, auto_loss_chunks, auto_mlp_shards, layer_saved_bytes
from offloadkit.planning.parallelism import (
    GRADIENT_BYTES,
    Parallelism,
    gather_bytes,
    gradient_exchange_bytes,
    kv_sequence_bytes,
    ring_buffer_bytes,
)
from offloadkit.planning.plan import Choice, place_inputs, planned_options, with_options
from offloadkit.planning.timing import LINK_BYTES_PER_S, Rates, step_flops

GiB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = resolve_shape("llama-3-8b")
BIG = Budgets(79 * GiB, 110 * GiB, 60 * GiB)


def _cp(world: int, per_host: int | None = None) -> Parallelism:
    return Parallelism(world, context_parallel=True, ranks_per_host=per_host or world)


def _options(tokens: int, shards: int | None = None, offload: bool = True) -> Choice:
    """The planner's own tiling for ``tokens`` on a rank (block inputs in RAM)."""
    w = Workload(SHAPE, tokens)
    return place_inputs(
        w,
        planned_options(
            w,
            offload_inputs=offload,
            loss_chunks=auto_loss_chunks(tokens, SHAPE.vocab),
            mlp_shards=shards if shards is not None else auto_mlp_shards(tokens, SHAPE.intermediate),
        ),
    )


# -- one GPU: as before ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq,lora,budgets",
    [
        (131072, 16, BIG),
        (16384, 0, Budgets(79 * GiB, 108 * GiB, 55 * GiB)),
        (1 << 20, 16, Budgets(141 * GiB, 108 * GiB, 55 * GiB)),
        (262144, 0, Budgets(40 * GiB, 30 * GiB, 60 * GiB)),
    ],
)
def test_one_gpu_is_planned_as_before(seq, lora, budgets):
    before = plan("llama-3-8b", seq, lora_rank=lora, budgets=budgets)
    for parallel in (Parallelism(), Parallelism(1, context_parallel=True, ranks_per_host=1)):
        p = plan("llama-3-8b", seq, lora_rank=lora, budgets=budgets, parallel=parallel)
        assert p.name == before.name and p.options == before.options
        assert p.memory == before.memory and p.time == before.time
        assert p.to_config() == before.to_config() and p.table() == before.table()
    assert before.time.ring_s == before.time.ring_wait_s == 0.0
    assert "ring attention buffers" not in before.memory.gpu_parts
    # Budgets for one rank on its host are the host's.
    one = Budgets.detect(budgets.gpu_bytes, budgets.host_bytes, budgets.disk_bytes, ranks_per_host=1)
    assert [getattr(one, f.name) for f in fields(Budgets) if f.name != "source"] == [
        getattr(budgets, f.name) for f in fields(Budgets) if f.name != "source"
    ]
    assert one.source == {"gpu": "given", "host": "given", "disk": "given"}


# -- a sequence split over ranks ----------------------------------------------------------------


def test_a_rank_holds_its_share_of_every_token_wise_part():
    split = Workload(SHAPE, 262144, parallel=_cp(2))
    half = Workload(SHAPE, 131072)
    whole = Workload(SHAPE, 262144)
    assert split.seq_len == 262144 and split.sequence_tokens == 262144
    assert split.tokens == half.tokens == whole.tokens // 2
    assert split.block_input_bytes == half.block_input_bytes == whole.block_input_bytes // 2
    for shards, tiled in ((1, False), (4, False), (4, True)):
        saved = layer_saved_bytes(split, shards, tiled)
        assert saved == layer_saved_bytes(half, shards, tiled) == layer_saved_bytes(whole, shards, tiled) // 2
    # Tiled: the attention side of a layer's backward is the larger, so the ring's buffers add in full.
    f = _options(split.tokens, shards=8)
    m, m_half, m_whole = estimate_memory(split, f), estimate_memory(half, f), estimate_memory(whole, f)
    assert m.phase == m_half.phase == "layer backward"
    parts = dict(m.gpu_parts)
    ring = parts.pop("ring attention buffers")
    assert ring == ring_buffer_bytes(split) > 0
    assert parts == m_half.gpu_parts  # everything else is the half-length step's
    assert m.gpu_peak == m_half.gpu_peak + ring
    for name in ("block inputs", "rotary", "residual stream", "layer recompute"):
        assert m.gpu_parts[name] * 2 == m_whole.gpu_parts[name], name
    assert m.gpu_parts["weights"] == m_whole.gpu_parts["weights"]
    # Block inputs in RAM: half as many bytes on the host.
    assert m.host - HOST_BASELINE_BYTES == (m_whole.host - HOST_BASELINE_BYTES) // 2
    assert m.block_placement == m_whole.block_placement


def test_ring_buffers_hold_the_whole_sequences_keys_and_values_of_one_layer():
    kv = kv_sequence_bytes(Workload(SHAPE, 1 << 20, parallel=_cp(2)))
    assert kv == (1 << 20) * 2 * SHAPE.kv_heads * SHAPE.head_dim * 2  # bf16 keys and values
    assert ring_buffer_bytes(Workload(SHAPE, 1 << 20)) == 0
    two = ring_buffer_bytes(Workload(SHAPE, 1 << 20, parallel=_cp(2)))
    four = ring_buffer_bytes(Workload(SHAPE, 1 << 20, parallel=_cp(4)))
    # The gathered keys and values stay the sequence's; what is per local token halves.
    assert kv < four < two and four - kv == (two - kv) // 2


def test_a_rank_computes_its_tokens_linears_and_an_even_share_of_causal_attention():
    split, half, whole = Workload(SHAPE, 262144, parallel=_cp(2)), Workload(SHAPE, 131072), Workload(SHAPE, 262144)
    f = _options(split.tokens)
    lf, lb, af, ab = step_flops(split, f)
    assert (lf, lb) == step_flops(half, f)[:2]
    assert af == step_flops(whole, f)[2] / 2 == 2 * step_flops(half, f)[2]
    assert ab == step_flops(whole, f)[3] / 2


# -- ring traffic -------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ring_traffic_is_the_other_ranks_share_of_keys_and_values(world):
    w = Workload(SHAPE, 1 << 20, parallel=_cp(world))
    kv = kv_sequence_bytes(w)
    assert gather_bytes(w) == kv * (world - 1) // world
    # The gradients go all the way round, each ring step the rank's share in fp32.
    assert gradient_exchange_bytes(w) * world == kv * GRADIENT_BYTES // w.dtype_bytes
    f = _options(w.tokens, offload=False)
    t = estimate_time(w, f, Rates(), ["gpu"] * SHAPE.layers)
    # Forward, the recompute and backward gather them; backward sends the gradients round.
    moved = SHAPE.layers * (3 * gather_bytes(w) + world * gradient_exchange_bytes(w))
    assert t.ring_s == pytest.approx(moved / LINK_BYTES_PER_S, rel=1e-12)
    # A layer whose attention output is kept runs no attention in the recompute: no gather there.
    kept = with_options(_options(w.tokens), CheckpointOptions, keep_attention=10)
    t = estimate_time(w, kept, Rates(), ["ram"] * (SHAPE.layers - 1) + ["gpu"])
    assert t.ring_s == pytest.approx((moved - 10 * gather_bytes(w)) / LINK_BYTES_PER_S, rel=1e-12)


def test_ring_traffic_grows_with_the_other_ranks_share():
    times = []
    for world in (2, 4, 8):
        w = Workload(SHAPE, 1 << 20, parallel=_cp(world))
        times.append(estimate_time(w, _options(w.tokens, offload=False), Rates(), ["gpu"] * SHAPE.layers).ring_s)
    assert times[0] < times[1] < times[2]


def test_ring_traffic_hides_behind_long_attention():
    """At 1M tokens over 4 ranks a layer's attention takes seconds and its keys and values
    tens of milliseconds: only the last gradient exchange of each layer is waited for."""
    w = Workload(SHAPE, 1 << 20, parallel=_cp(4))
    f = _options(w.tokens, offload=False)
    t = estimate_time(w, f, Rates(), ["gpu"] * SHAPE.layers)
    last_exchanges = SHAPE.layers * gradient_exchange_bytes(w) / LINK_BYTES_PER_S
    assert t.ring_wait_s == pytest.approx(last_exchanges, rel=1e-12)
    assert t.ring_s > 8 * t.ring_wait_s and t.bound == "compute"


def test_ring_traffic_attention_cannot_hide_adds_to_the_step():
    w = Workload(SHAPE, 16384, parallel=_cp(8))
    f = _options(w.tokens, offload=False)
    placement = ["gpu"] * SHAPE.layers
    fast = estimate_time(w, f, Rates(link_bytes_per_s=1e30), placement)
    slow = estimate_time(w, f, Rates(link_bytes_per_s=100e9), placement)
    assert fast.ring_wait_s < 1e-9 and slow.ring_wait_s > 0.02
    assert slow.seconds == pytest.approx(fast.seconds + slow.ring_wait_s, rel=1e-12)
    assert slow.compute_s == fast.compute_s and slow.bound == "compute"
    crawl = estimate_time(w, f, Rates(link_bytes_per_s=2e9), placement)
    assert crawl.bound == "ring" and crawl.ring_wait_s > crawl.compute_s
    # Ranks of one sequence on two hosts: the network between them carries the same bytes.
    hosts = replace(w, parallel=_cp(8, per_host=4))
    rates = Rates(link_bytes_per_s=150e9, network_bytes_per_s=40e9)
    within, between = estimate_time(w, f, rates, placement), estimate_time(hosts, f, rates, placement)
    assert between.ring_s * 40e9 == pytest.approx(within.ring_s * 150e9, rel=1e-12)


# -- the host's RAM and disk, shared ------------------------------------------------------------


def test_each_rank_plans_on_its_share_of_the_hosts_ram_and_disk():
    b = Budgets.detect(80 * GiB, 400 * GiB, 200 * GiB, ranks_per_host=4)
    assert (b.gpu_bytes, b.host_bytes, b.disk_bytes) == (80 * GiB, 100 * GiB, 50 * GiB)
    assert "divided by 4 ranks on this host" in b.source["host"] and "divided by 4" in b.source["disk"]
    # One rank's own cap (host_budget_bytes) is that rank's already.
    capped = Budgets.detect(80 * GiB, disk_bytes=200 * GiB, host_bytes_per_rank=30 * GiB, ranks_per_host=4)
    assert capped.host_bytes == 30 * GiB and capped.disk_bytes == 50 * GiB
    with pytest.raises(ValueError, match="host_bytes=.*host_bytes_per_rank=.*not both"):
        Budgets.detect(80 * GiB, 400 * GiB, 200 * GiB, host_bytes_per_rank=30 * GiB)
    with pytest.raises(ValueError, match=r"ranks_per_host=0 is invalid.*int >= 1"):
        Budgets.detect(80 * GiB, 400 * GiB, 200 * GiB, ranks_per_host=0)


def test_detect_under_a_launcher_divides_the_host_by_its_local_ranks(monkeypatch):
    import offloadkit.storage.budget as host_budget

    monkeypatch.setattr(host_budget, "_available_bytes", lambda: 300 * GiB)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(4 << 40, 0, 2 << 40))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    alone = Budgets.detect(80 * GiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    shared = Budgets.detect(80 * GiB)
    assert alone.host_bytes > 200 * GiB
    assert shared.host_bytes == alone.host_bytes // 4 and shared.disk_bytes == alone.disk_bytes // 4
    assert "(LOCAL_WORLD_SIZE)" in shared.source["host"] and "(LOCAL_WORLD_SIZE)" in shared.source["disk"]
    # Given, the ranks on the host win over the launcher's count.
    two = Budgets.detect(80 * GiB, ranks_per_host=2)
    assert two.host_bytes == alone.host_bytes // 2 and two.disk_bytes == alone.disk_bytes // 2


def test_more_ranks_on_a_host_fit_shorter_sequences_when_its_ram_binds():
    host = (79 * GiB, 64 * GiB, 1 * GiB)  # one host's budgets; almost no disk
    apart = longest_sequence("llama-3-8b", budgets=Budgets.detect(*host, ranks_per_host=1), parallel=_cp(4, per_host=1))
    together = longest_sequence(
        "llama-3-8b", budgets=Budgets.detect(*host, ranks_per_host=4), parallel=_cp(4, per_host=4)
    )
    assert 0 < together.longest < apart.longest
    # Alone on its host a rank's plan at its longest uses more RAM than a quarter of the host.
    assert apart.plan.memory.host - HOST_BASELINE_BYTES > 16 * GiB
    assert together.plan.memory.host - HOST_BASELINE_BYTES <= 16 * GiB


# -- sequence lengths ---------------------------------------------------------------------------


def test_a_sequence_splits_into_head_tail_chunks_or_is_refused():
    with pytest.raises(ValueError, match=r"seq_len=1001 .* multiple of 2 x world_size = 8: pad to 1008"):
        plan("llama-3-8b", 1001, budgets=BIG, parallel=_cp(4))
    with pytest.raises(ValueError, match=r"world_size=0 is invalid"):
        Parallelism(0)
    with pytest.raises(ValueError, match=r"ranks_per_host=0 is invalid"):
        Parallelism(2, context_parallel=True, ranks_per_host=0)
    with pytest.raises(ValueError, match=r"context_parallel='yes' is invalid"):
        Parallelism(2, context_parallel="yes")  # type: ignore[arg-type]
    # Three ranks: searched in multiples of 6 as well as of 1024; the lengths are the whole sequence's.
    cap = longest_sequence("llama-3-8b", budgets=BIG, parallel=_cp(3))
    assert cap.longest % 3072 == 0 and cap.plan.workload.seq_len == cap.longest
    assert cap.plan.workload.tokens == cap.longest // 3
    assert f"longest sequence that fits: {cap.longest} tokens across 3 ranks ({cap.longest // 3} each)" in cap.summary()


# -- offloadkit plan --world-size --------------------------------------------------------------


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("LOCAL_WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "offloadkit", "plan", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def test_cli_plans_one_rank_of_the_world_size():
    yaml = pytest.importorskip("yaml")
    budgets = ("--gpu-gib", "79", "--host-gib", "220", "--disk-gib", "120")
    r = _cli("--shape", "llama-3-8b", "--seq-len", "262144", "--world-size", "2", *budgets)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    expected = plan(
        "llama-3-8b",
        262144,
        budgets=Budgets.detect(79 * GiB, 220 * GiB, 120 * GiB, ranks_per_host=2),
        parallel=_cp(2),
        fused_lora=True,  # the command's default with LoRA, as offload_plan: auto runs it
    )
    assert lines[0].startswith(
        "per rank of 2 (context parallel: 131072 of the 262144 tokens each; host RAM and disk shared by 2 ranks): "
        f"fits: {expected.name}, GPU {expected.memory.gpu_reserved / GiB:.1f}/79.0 GiB, host "
    )
    assert "/110.0 GiB, disk " in lines[0] and lines[0].endswith("/60.0 GiB")
    start = lines.index("# offloadkit config keys for this plan") + 1
    block = lines[start : lines.index("", start)]
    assert block[0].startswith("# ") and "seq_len is the whole sequence, 131072 tokens of it on each rank" in block[0]
    keys = yaml.safe_load("\n".join(block))
    assert keys["seq_len"] == 262144
    assert keys["block_input_placement"] == list(expected.to_config()["block_input_placement"])
    # Loss chunks for the rank's tokens, not the sequence's.
    assert (
        keys["chunked_cross_entropy_num_chunks"]
        == auto_loss_chunks(131072, SHAPE.vocab)
        < auto_loss_chunks(262144, SHAPE.vocab)
    )
    assert any(re.match(r"predicted step time: .* tokens/s across the 2 ranks, \d+ TFLOP/s on each", x) for x in lines)
    assert any(x.startswith("ring attention: ") and "150 GB/s (within the host)" in x for x in lines)
    assert "host: given, divided by 2 ranks on this host" in r.stdout
    assert re.search(r"longest sequence that fits: (\d+) tokens across 2 ranks \(\d+ each\)", r.stdout)
    verbose = _cli(
        "--shape", "llama-3-8b", "--seq-len", "262144", "--world-size", "2", "--no-search", "--verbose", *budgets
    )
    assert "| layers | block input | kept in |" in verbose.stdout
    assert "262144 tokens x 1 (per rank of 2: 131072 tokens each), LoRA r=16: " in verbose.stdout


def test_cli_refuses_what_ranks_cannot_split():
    for args in (("--seq-len", "1001", "--world-size", "4"), ("--seq-len", "1024", "--world-size", "0")):
        r = _cli("--shape", "tiny", *args, "--no-search")
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert r.stderr.startswith("offloadkit: error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- offload_plan: auto under a launcher ---------------------------------------------------------


def test_offload_plan_auto_under_a_launcher_plans_one_rank(monkeypatch):
    pytest.importorskip("transformers")
    import torch.distributed as dist

    from offloadkit.compose import plan_for, prepare, run_parallelism
    from offloadkit.config import OffloadConfig
    from offloadkit.testing import build_llama

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(4 << 40, 0, 2 << 40))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert run_parallelism() == Parallelism(4, context_parallel=False, ranks_per_host=2)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    assert run_parallelism() == Parallelism(8, context_parallel=False, ranks_per_host=2)

    model = build_llama("tiny")
    config = OffloadConfig(offload_plan="auto", seq_len=512, host_budget_bytes=1 * GiB)
    own = plan_for(model, config)
    assert own.workload.parallel == Parallelism(8, context_parallel=False, ranks_per_host=2)
    assert own.workload.tokens == 512  # each rank its own sequences
    assert own.budgets.host_bytes == 1 * GiB  # host_budget_bytes caps one rank: not shared again
    assert own.budgets.disk_bytes == int((2 << 40) * 0.95) // 2
    # A loop that splits each sequence says so; seq_len is then the whole sequence.
    split = Parallelism(2, context_parallel=True, ranks_per_host=2)
    runtime = prepare(model, {"offload_plan": "auto", "seq_len": 1024}, parallel=split)
    try:
        assert runtime.plan.workload.parallel == split and runtime.plan.workload.tokens == 512
        assert runtime.report()["plan"]["parallel"] == {"world_size": 2, "context_parallel": True, "ranks_per_host": 2}
    finally:
        runtime.close()
