"""The planner: its byte accounting against what a tiny Llama really saves and offloads,
monotonicity, budget-limited searches, the config it produces, prepare() with
offload_plan: auto, and the ``offloadkit plan`` command."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.checkpointing.footprint import keeps_attention
from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import OptionSet
from offloadkit.compose import prepare
from offloadkit.config import ConfigError, OffloadConfig
from offloadkit.engine.options import ActivationOptions
from offloadkit.layers.options import StreamingOptions
from offloadkit.longctx import chunked_cross_entropy
from offloadkit.longctx.options import LongContextOptions
from offloadkit.optim.options import OptimizerOptions
from offloadkit.planning import Budgets, Workload, estimate_memory, longest_sequence, plan, resolve_shape
from offloadkit.planning.memory import LOSS_CHUNK_BYTES_PER_LOGIT, auto_loss_chunks, layer_saved_bytes
from offloadkit.planning.plan import input_counts, option, place_inputs, planned_options, with_options
from offloadkit.testing import AllocationTracker, build_llama

pytest.importorskip("transformers")
GiB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIG = Budgets(79 * GiB, 110 * GiB, 60 * GiB)


def _saved_in_layer(model, ids, index):
    from offloadkit.testing.allocations import saved_bytes_in_layer

    return saved_bytes_in_layer(model, {"input_ids": ids, "labels": ids}, index)


@pytest.mark.parametrize(
    "lora,tiled", [(0, False), (8, False), (8, True), (0, True), (8, "projections"), (0, "projections")]
)
def test_layer_saved_bytes_match_what_autograd_saves(lora, tiled):
    from offloadkit import apply_tiled_mlp

    model = build_llama("tiny", dtype=torch.bfloat16, attn_implementation="sdpa", num_hidden_layers=3)
    model.config.use_cache = False
    if lora:
        from offloadkit.integrations.peft_utils import apply_lora

        model = apply_lora(model, rank=lora)
        model.enable_input_require_grads()  # as under checkpointing: layer inputs require grad
    model.train()
    if tiled:
        apply_tiled_mlp(model, num_shards=4, projections=tiled == "projections")
    # SDPA's output is the o projection's input when the kernel returns it in [B, S, H, D]
    # memory (CUDA kernels; the CPU kernel only at batch 1, else the projection copies it).
    batch, seq = (1, 512) if tiled == "projections" else (2, 256)
    ids = torch.randint(0, 256, (batch, seq))
    measured = _saved_in_layer(model, ids, 1)
    w = Workload(resolve_shape("tiny"), seq, batch, lora_rank=lora)
    predicted = layer_saved_bytes(w, mlp_shards=4 if tiled else 1, tiled_projections=tiled == "projections")
    if tiled == "projections":  # the tiled input norm keeps the layer's input: the block input under checkpointing
        predicted += w.block_input_bytes
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)
    if tiled == "projections":  # no fp32 norm upcasts and no adapter input copies: bf16 [S, H] inputs only
        untiled = layer_saved_bytes(w, mlp_shards=4)
        assert measured < (0.5 if lora else 0.75) * untiled, (measured, untiled)


def test_block_inputs_offloaded_as_planned():
    model = build_llama("tiny", num_hidden_layers=4, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    handle = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True, storage="disk")
    try:
        ids = torch.randint(0, 256, (2, 128))
        model(input_ids=ids, labels=ids).loss.backward()
        offloaded = handle.offloader.collect_stats().offloaded_bytes
    finally:
        handle.remove()
    w = Workload(resolve_shape("tiny", layers=4), 128, 2, lora_rank=0, dtype_bytes=4)
    m = estimate_memory(w, place_inputs(w, planned_options(w, offload_inputs=True)))
    planned = sum(p != "gpu" for p in m.block_placement) * w.block_input_bytes
    assert m.block_placement == ["ram", "ram", "ram", "gpu"]
    # The rest are the rotary tables and position ids passed to each block (counted as
    # GPU-resident "rotary" by the planner): less than one block input.
    assert planned <= offloaded < planned + w.block_input_bytes


@pytest.mark.parametrize("held", [1, 2])
def test_block_inputs_held_on_the_gpu_as_planned(held):
    """``gpu_block_inputs`` keeps the newest block inputs where they are: exactly the planned
    bytes leave, and the step is bitwise the one that offloads them all."""
    from offloadkit.testing import assert_bitwise_equal, run_step

    model = build_llama("tiny", num_hidden_layers=4, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    moved, steps = [], []
    for keep in (1, 1 + held):
        handle = apply_activation_checkpointing(
            model, offload_inputs=True, offload_cpu_tensors=True, storage="disk", keep_last_input=keep
        )
        try:
            steps.append(run_step(model, batch))
            moved.append(handle.offloader.collect_stats().offloaded_bytes)
        finally:
            handle.remove()
    w = Workload(resolve_shape("tiny", layers=4), 128, 2, lora_rank=0, dtype_bytes=4)
    m = estimate_memory(w, place_inputs(w, planned_options(w, offload_inputs=True), gpu_blocks=held))
    assert m.block_placement == ["ram"] * (3 - held) + ["gpu"] * (held + 1)
    # Each block input held back is one block input's bytes (and its rotary tables) fewer.
    per_block = (moved[0] - moved[1]) / held
    assert w.block_input_bytes <= per_block < 2 * w.block_input_bytes
    assert_bitwise_equal(steps[0][0], steps[1][0], "loss")
    assert_bitwise_equal(steps[0][1], steps[1][1], "grads")
    with pytest.raises(ValueError, match="keep_last_input=-1 is invalid"):
        apply_activation_checkpointing(model, keep_last_input=-1)


def test_gpu_block_inputs_config_reaches_checkpointing():
    model = build_llama("tiny", num_hidden_layers=4)
    runtime = prepare(
        model,
        {"gradient_checkpointing": True, "activation_offloading": "disk", "gpu_block_inputs": 2},
    )
    try:
        assert runtime.checkpointing._keep_last == 3
    finally:
        runtime.close()
    with pytest.raises(ConfigError, match="gpu_block_inputs=-1 is too small"):
        OffloadConfig.from_dict({"gpu_block_inputs": -1})


@pytest.mark.parametrize("gpu_gib", [16, 24, 48, 80, 141])
def test_nine_tenths_of_the_physical_limit_at_every_gpu_size(gpu_gib):
    """8B LoRA r=16 with 108 GiB of host RAM and 55 GiB of disk: small GPUs tile finer (and keep
    one streamed layer resident at the edge), large ones hold block inputs the RAM and disk
    cannot."""
    cap = longest_sequence("llama-3-8b", lora_rank=16, budgets=Budgets(gpu_gib * GiB, 108 * GiB, 55 * GiB))
    assert cap.ratio >= 0.9, cap.summary()
    p = cap.plan
    assert (
        p.fits
        and OffloadConfig.from_dict(p.to_config()).layer_offloading_depth == option(p.options, StreamingOptions).depth
    )
    if gpu_gib >= 80:
        # Past what storage holds, block inputs are dropped and replayed instead.
        assert "recompute" in p.placement and "disk" in p.placement


def test_one_streamed_layer_resident_is_chosen_only_when_needed():

    from offloadkit.planning import estimate_time

    small = Budgets(16 * GiB, 108 * GiB, 55 * GiB)
    edge = longest_sequence("llama-3-8b", lora_rank=16, budgets=small).plan
    assert option(edge.options, StreamingOptions).depth == 1 and edge.to_config()["layer_offloading_depth"] == 1
    # Waiting for each layer's weights costs time, so with room the plan keeps two resident.
    two = estimate_time(
        edge.workload, with_options(edge.options, StreamingOptions, depth=2), small.rates, edge.placement
    )
    assert edge.time.seconds > two.seconds
    assert option(plan("llama-3-8b", 16384, lora_rank=16, budgets=small).options, StreamingOptions).depth == 2


def test_loss_chunk_bytes_match_the_chunked_loss():
    tokens, hidden, vocab = 512, 32, 1000
    w = Workload(
        resolve_shape(
            {
                "hidden_size": hidden,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "vocab_size": vocab,
            }
        ),
        tokens,
        lora_rank=0,
        dtype_bytes=4,
    )
    chunks = 8
    part = estimate_memory(w, planned_options(w, loss_chunks=chunks)).gpu_parts
    h = torch.randn(tokens, hidden, requires_grad=True)
    weight = torch.randn(vocab, hidden)
    labels = torch.randint(0, vocab, (tokens,))
    with AllocationTracker() as t:
        chunked_cross_entropy(h, weight, labels, num_chunks=chunks, shift=False).backward()
    largest_fp32 = max(n for _, _, n, dt in t.records if dt == torch.float32 and n != tokens * hidden)
    assert largest_fp32 == tokens // chunks * vocab
    if "loss chunk" in part:
        assert part["loss chunk"] == largest_fp32 * LOSS_CHUNK_BYTES_PER_LOGIT
    assert auto_loss_chunks(16384, 128256) == 8  # 2**28 // 128256 = 2092 tokens per chunk


def test_full_fine_tune_counts_the_chunked_loss_fp32_head_gradient():
    """The chunked loss sums a trainable head's gradient in fp32 in forward and holds it to
    backward: measured against what the loss allocates, and left out for LoRA."""
    tokens, hidden, vocab = 256, 32, 1000
    shape = resolve_shape(
        {
            "hidden_size": hidden,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "vocab_size": vocab,
        }
    )
    full_w, lora_w = (Workload(shape, tokens, lora_rank=r, dtype_bytes=2) for r in (0, 8))
    full = estimate_memory(full_w, planned_options(full_w, loss_chunks=4)).gpu_parts
    lora = estimate_memory(lora_w, planned_options(lora_w, loss_chunks=4)).gpu_parts
    h = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    with AllocationTracker() as t:
        chunked_cross_entropy(h, weight, labels, num_chunks=4, shift=False)
    held = [n * 4 for _, _, n, dt in t.records if dt == torch.float32 and n == vocab * hidden]
    assert held and full["head weight gradient (fp32)"] == held[0] == vocab * hidden * 4
    assert "head weight gradient (fp32)" not in lora
    eight_b_w = Workload(resolve_shape("llama-3-8b"), 4096, lora_rank=0)
    eight_b = estimate_memory(eight_b_w, planned_options(eight_b_w, loss_chunks=1))
    assert eight_b.gpu_parts["head weight gradient (fp32)"] == 128256 * 4096 * 4  # 1.96 GiB


def test_more_tokens_more_memory_and_time():
    """The chosen plans take more storage and time as the length grows; each plan's own
    options take more GPU at a greater length (the fastest plan at a longer length may
    tile more and so peak lower)."""
    previous = None
    for seq in (8192, 16384, 65536, 131072, 262144):
        p = plan("llama-3-8b", seq, budgets=BIG)
        now = (p.memory.host + p.memory.disk, p.time.seconds)
        if previous is not None:
            assert all(a < b for a, b in zip(previous, now)), (seq, previous, now)
        longer = estimate_memory(replace(p.workload, seq_len=2 * seq), p.options)
        assert longer.gpu_peak > p.memory.gpu_peak
        previous = now


def test_depth_does_not_change_the_gpu_peak_when_offloading_and_streaming():
    at = {n: Workload(resolve_shape("llama-3-8b", layers=n), 65536) for n in (8, 32)}
    chosen = dict(loss_chunks=32, mlp_shards=4)
    f = {
        n: place_inputs(w, planned_options(w, offload_inputs=True, layer_streaming=True, **chosen))
        for n, w in at.items()
    }
    est = {n: estimate_memory(w, f[n]) for n, w in at.items()}
    # Only the LoRA adapters and their AdamW state grow with depth (0.5 GiB at 32 layers).
    peaks = {n: m.gpu_peak - m.gpu_parts["trainable state"] for n, m in est.items()}
    assert peaks[8] == peaks[32]
    plain = planned_options(at[32], **chosen)
    assert estimate_memory(at[32], plain).gpu_peak > estimate_memory(at[8], plain).gpu_peak


def test_ram_exhaustion_pushes_oldest_block_inputs_to_disk():
    small_ram = Budgets(48 * GiB, 40 * GiB, 200 * GiB)
    p = plan("llama-3-8b", 262144, budgets=small_ram)
    assert p.fits, p.reasons
    assert p.placement[0] == "disk" and p.placement[-1] == "gpu"
    # Oldest on disk, then RAM, then the newest on the GPU (the last one, and as many more
    # as the GPU's room holds: RAM and disk are the short ones here).
    first_ram, first_gpu = p.placement.index("ram"), p.placement.index("gpu")
    assert set(p.placement[:first_ram]) == {"disk"} and set(p.placement[first_ram:first_gpu]) == {"ram"}
    assert set(p.placement[first_gpu:]) == {"gpu"}
    assert input_counts(p.workload, p.options)[0] == len(p.placement) - first_gpu - 1
    cfg = OffloadConfig.from_dict(p.to_config())
    assert cfg.block_input_placement == tuple(p.placement)
    assert cfg.activation_offloading == "disk" and cfg.disk_tiering and cfg.host_budget_bytes <= 40 * GiB
    assert p.memory.disk == p.placement.count("disk") * p.workload.block_input_bytes
    assert p.time.disk_s > 0


def test_tiny_budgets_give_a_short_longest_sequence():
    roomy = longest_sequence("llama-3-8b", budgets=BIG)
    tight = longest_sequence("llama-3-8b", budgets=Budgets(12 * GiB, 24 * GiB, 1 * GiB))
    assert 0 < tight.longest < roomy.longest
    assert tight.longest <= tight.physical and roomy.longest <= roomy.physical
    assert plan("llama-3-8b", tight.longest, budgets=tight.plan.budgets).fits
    assert not plan("llama-3-8b", tight.longest + 4096, budgets=tight.plan.budgets).fits
    nothing = longest_sequence("llama-3-8b", budgets=Budgets(1 * GiB, 1 * GiB, 1 * GiB))
    assert nothing.longest == 0 and nothing.plan is None


def test_offload_plan_config_validation():
    assert OffloadConfig.from_dict({"offload_plan": "auto", "seq_len": 4096}).offload_plan == "auto"
    with pytest.raises(ConfigError, match="offload_plan='sometimes'"):
        OffloadConfig.from_dict({"offload_plan": "sometimes"})
    with pytest.raises(ConfigError, match="seq_len=0"):
        OffloadConfig.from_dict({"offload_plan": "auto", "seq_len": 0})
    with pytest.raises(ConfigError, match="did you mean 'offload_plan'"):
        OffloadConfig.from_dict({"offload_plans": "auto"})


def test_every_prepared_run_maps_expandable_segments_until_closed(monkeypatch):
    """Not only planned runs: fixed-size segments reserved 1.39x what a 3B full fine-tune
    allocated (benchmarks/results/trainer-overheads)."""
    import offloadkit.compose as compose

    switched = []
    monkeypatch.setattr(compose, "use_expandable_segments", lambda on=True: switched.append(on) or True)
    runtime = prepare(build_llama("tiny", attn_implementation="sdpa"), {"gradient_checkpointing": True})
    assert switched == [True]
    runtime.close()
    assert switched == [True, False]


def test_prepare_applies_the_plan(monkeypatch):
    import offloadkit.compose as compose
    from offloadkit.integrations.peft_utils import apply_lora

    switched = []
    monkeypatch.setattr(compose, "use_expandable_segments", lambda on=True: switched.append(on) or True)
    model = apply_lora(build_llama("tiny", attn_implementation="sdpa"), rank=4)
    with pytest.raises(ConfigError, match="needs the sequence length"):
        prepare(model, {"offload_plan": "auto"})
    runtime = prepare(model, {"offload_plan": "auto", "host_budget_bytes": "2GiB"}, seq_len=4096)
    assert switched == [True], "a planned run gets the allocator its reservation figure assumes"
    try:
        assert runtime.plan is not None and runtime.plan.workload.lora_rank == 4
        assert runtime.plan.workload.shape.layers == 2
        assert runtime.config.gradient_checkpointing and runtime.checkpointing is not None
        assert runtime.config.chunked_cross_entropy and runtime.chunked_loss is not None
        assert runtime.chunked_loss is not None
        assert runtime.report()["plan"]["placement"] == runtime.plan.placement
        ids = torch.randint(0, 256, (1, 64))
        with runtime.context():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss)
    finally:
        runtime.close()
    assert switched == [True, False], "close() puts the allocator's default back"


def test_a_plan_that_drops_block_inputs_runs_bitwise_through_prepare(tmp_path):
    """The recompute placement as prepare() realises it from the plan's config keys: the
    dropped inputs reach checkpointing, the kept ones the disk tier, and the step is bitwise
    per-block checkpointing."""
    from offloadkit.planning import estimate_time
    from offloadkit.planning.planner import Plan

    shape = {"num_hidden_layers": 6}
    ref, ours = build_llama("tiny", **shape), build_llama("tiny", **shape)
    w = Workload(resolve_shape(ours), 64, batch=2, lora_rank=0, dtype_bytes=4)
    f = place_inputs(w, planned_options(w, offload_inputs=True, loss_chunks=1), recompute_blocks=2)
    m = estimate_memory(w, f)
    p = Plan(w, f, BIG, "drops", m, estimate_time(w, f, BIG.rates, m.block_placement), True)
    assert p.placement == ["ram", "ram", "recompute", "ram", "recompute", "gpu"]
    config = dict(p.to_config(), activation_offloading="disk", disk_dir=str(tmp_path), chunked_cross_entropy=False)
    assert config["block_input_placement"] == tuple(p.placement)
    apply_activation_checkpointing(ref)
    runtime = prepare(ours, config)
    try:
        assert runtime.checkpointing.recompute_inputs == {2, 4}
        ids = torch.randint(0, 256, (2, 64))
        expected = ref(input_ids=ids, labels=ids).loss
        expected.backward()
        with runtime.context():
            got = ours(input_ids=ids, labels=ids).loss
        got.backward()
        assert torch.equal(expected, got)
        for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
            assert torch.equal(a.grad, b.grad), name
    finally:
        runtime.close()


@pytest.mark.parametrize(
    "placement",
    [
        ("disk", "ram", "recompute", "disk", "recompute", "gpu"),
        ("ram", "disk", "ram", "disk", "gpu", "gpu"),
        ("disk", "gpu", "ram", "ram", "disk", "ram"),
    ],
)
def test_an_explicit_placement_puts_each_block_input_where_it_says(tmp_path, placement):
    """``block_input_placement``: each block input goes where its place says (disk ones
    straight to disk, RAM ones stay in RAM, never demoted; gpu ones kept; recompute ones
    nowhere), not where the tiered store's oldest-first order would put it; bitwise."""
    shape = {"num_hidden_layers": 6}
    ref, ours = build_llama("tiny", **shape), build_llama("tiny", **shape)
    apply_activation_checkpointing(ref)
    config = {
        "gradient_checkpointing": True,
        "activation_offloading": "disk",
        "disk_tiering": True,
        "disk_dir": str(tmp_path),
        "block_input_placement": list(placement),  # as YAML gives it
    }
    runtime = prepare(ours, config)
    block = 2 * 64 * ours.config.hidden_size * 4
    try:
        ids = torch.randint(0, 256, (2, 64))
        expected = ref(input_ids=ids, labels=ids).loss
        expected.backward()
        with runtime.context():
            got = ours(input_ids=ids, labels=ids).loss
            on_disk = runtime.manager.storage_stats()["disk"]["bytes_on_disk"]
        got.backward()
        assert torch.equal(expected, got)
        for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
            assert torch.equal(a.grad, b.grad), name
        report = runtime.report()
        tiered = report["storage"]["tiered"]
        # Disk places are written out of their RAM buffer right away; nothing else moves.
        assert tiered["demoted_entries"] == placement.count("disk") and tiered["disk_entries"] == 0
        assert report["storage"]["disk"]["bytes_written"] == placement.count("disk") * block
        assert on_disk == placement.count("disk") * block
        kept = report["activations"]["kept_by_reason"]
        trailing = 0
        while trailing < len(placement) and placement[-1 - trailing] == "gpu":
            trailing += 1
        # The last blocks' gpu places are the kept tail; one before them is kept by its place.
        assert kept.get("placed", 0) == placement.count("gpu") - trailing
        assert runtime.checkpointing.recompute_inputs == {i for i, w in enumerate(placement) if w == "recompute"}
    finally:
        runtime.close()


def test_explicit_placement_errors_are_clear():
    with pytest.raises(ConfigError, match="block_input_placement=.*is invalid"):
        OffloadConfig.from_dict({"block_input_placement": ["ram", "nvme"]})
    with pytest.raises(ConfigError, match="layer 0's input cannot be recomputed"):
        OffloadConfig.from_dict({"block_input_placement": ["recompute", "gpu"]})
    with pytest.raises(ConfigError, match="set activation_offloading: disk"):
        OffloadConfig.from_dict({"block_input_placement": ["disk", "gpu"]})
    with pytest.raises(ConfigError, match="give only block_input_placement"):
        OffloadConfig.from_dict({"block_input_placement": ["ram", "gpu"], "gpu_block_inputs": 1})
    with pytest.raises(ValueError, match="one place per block \\(4 blocks\\)"):
        apply_activation_checkpointing(build_llama("tiny", num_hidden_layers=4), placement=["ram", "gpu"])


def test_gpu_budget_is_planned_for_and_noted_without_cuda():
    from offloadkit.integrations.peft_utils import apply_lora

    assert OffloadConfig.from_dict({"gpu_budget_bytes": "24GiB"}).gpu_budget_bytes == 24 * GiB
    with pytest.raises(ConfigError, match="gpu_budget_bytes"):
        OffloadConfig.from_dict({"gpu_budget_bytes": -1})
    model = apply_lora(build_llama("tiny", attn_implementation="sdpa"), rank=4)
    with pytest.warns(UserWarning, match="gpu_budget_bytes has no effect without a CUDA GPU"):
        runtime = prepare(
            model, {"offload_plan": "auto", "host_budget_bytes": "2GiB", "gpu_budget_bytes": "3GiB"}, seq_len=4096
        )
    try:
        assert runtime.plan.budgets.gpu_bytes == 3 * GiB and runtime.plan.budgets.source["gpu"] == "given"
    finally:
        runtime.close()


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "offloadkit", "plan", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def test_cli_plan_prints_the_verdict_the_keys_as_yaml_and_the_longest_sequence():
    yaml = pytest.importorskip("yaml")
    budgets = ("--gpu-gib", "79", "--host-gib", "110", "--disk-gib", "60")
    r = _cli("--shape", "llama-3-8b", "--seq-len", "131072", *budgets)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    # LoRA layers fused: the command's default, as offload_plan: auto runs a 16-bit LoRA model.
    expected = plan("llama-3-8b", 131072, budgets=Budgets(79 * GiB, 110 * GiB, 60 * GiB), fused_lora=True)
    assert lines[0].startswith(f"fits: {expected.name}, GPU {expected.memory.gpu_reserved / GiB:.1f}/79.0 GiB, host ")
    start = lines.index("# offloadkit config keys for this plan") + 1
    block = lines[start : lines.index("", start)]
    keys = yaml.safe_load("\n".join(block))
    placement = list(expected.to_config()["block_input_placement"])
    assert keys["seq_len"] == 131072 and keys["block_input_placement"] == placement
    assert "layer_offloading_depth" not in keys and "disk_tiering" not in keys  # at their defaults: omitted
    assert all("(" not in line and "True" not in line for line in block)  # YAML, not Python reprs
    # The keys as printed are a config offloadkit reads, with the plan's settings.
    assert OffloadConfig.from_dict(keys).block_input_placement == tuple(placement)
    assert any(line.startswith("predicted step time: ") for line in lines)
    assert "longest sequence that fits" in r.stdout and "physically allowed" in r.stdout
    assert "not chosen" not in r.stdout and "| layers |" not in r.stdout
    assert "Traceback" not in r.stderr
    verbose = _cli("--shape", "llama-3-8b", "--seq-len", "131072", "--no-search", "--verbose", *budgets)
    assert "| layers | block input | kept in |" in verbose.stdout and "not chosen: " in verbose.stdout


def test_cli_plan_that_does_not_fit_names_the_budget_and_the_nearest_that_fits():
    budgets = ("--gpu-gib", "40", "--host-gib", "30", "--disk-gib", "60")
    r = _cli("--shape", "llama-3-8b", "--seq-len", "1048576", "--lora-rank", "0", *budgets)
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("does not fit: GPU needs ") and " GiB of 40.0" in lines[0]
    cap = longest_sequence("llama-3-8b", lora_rank=0, budgets=Budgets(40 * GiB, 30 * GiB, 60 * GiB))
    assert f"suggestion: seq_len: {cap.longest} fits these budgets (the longest that does)" in lines


def test_cli_plan_help_lists_every_built_in_shape():
    from offloadkit.models.zoo import LLAMA_SHAPES

    text = " ".join(_cli("--help").stdout.split())
    for name in LLAMA_SHAPES:
        assert name in text


def test_cli_plan_bad_arguments_give_one_line():
    for args in (
        ("--shape", "nope", "--seq-len", "1024"),
        ("--shape", "tiny", "--seq-len", "0"),
        ("--shape", "tiny", "--seq-len", "1024", "--gpu-gib", "-1"),
    ):
        r = _cli(*args, "--no-search")
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert r.stderr.startswith("offloadkit: error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_long_plans_tile_projections_and_shorten_the_horizon_only_when_needed():
    budgets = Budgets(int(78.18 * GiB), 109 * GiB, 60 * GiB)
    long = plan("llama-3-8b", 589824, lora_rank=16, budgets=budgets)
    cfg = long.to_config()
    assert long.fits, long.reasons
    assert cfg["tiled_projections"] and cfg["tiled_mlp"] and cfg["activation_loading_horizon"] == 1
    # The last one, one fetched ahead, and those the GPU's spare room holds (disk is short).
    held = input_counts(long.workload, long.options)[0]
    assert held > 0 and cfg["block_input_placement"][-1 - held :] == ("gpu",) * (1 + held)
    assert long.memory.gpu_parts["block inputs"] == (2 + held) * long.workload.block_input_bytes
    OffloadConfig.from_dict(cfg)  # a valid config
    # Without the projections tiled the same step does not fit.
    untiled = estimate_memory(long.workload, with_options(long.options, LongContextOptions, tiled_projections=False))
    assert untiled.gpu_reserved > budgets.gpu_bytes
    # 128K fits untiled: the faster plan wins (the projections' extra forward is not paid).
    assert not plan("llama-3-8b", 131072, lora_rank=16, budgets=budgets).to_config()["tiled_projections"]
    # Short sequences: nothing tiled past the MLP, the engine's default horizon.
    short = plan("llama-3-8b", 16384, lora_rank=16, budgets=budgets).to_config()
    assert not short["tiled_projections"] and "activation_loading_horizon" not in short
    cap = longest_sequence("llama-3-8b", lora_rank=16, budgets=budgets)
    assert cap.longest >= 589824, cap.summary()


H100 = Budgets(int(78.18 * GiB), int(109.1 * GiB), int(60.8 * GiB))  # the lent H100's budgets


def test_physical_limit_holds_everything_alive_at_once():
    from offloadkit.planning import physical_limit
    from offloadkit.planning.planner import SEQ_STEP

    physical, limit = physical_limit("llama-3-8b", budgets=H100)
    shape = resolve_shape("llama-3-8b")

    def alive(seq, drops=0):
        w = Workload(shape, seq)
        f = planned_options(
            w,
            offload_inputs=True,
            layer_streaming=True,
            loss_chunks=seq,
            mlp_shards=seq,
            tiled_projections=True,
            head_groups=shape.kv_heads,
        )
        f = place_inputs(w, with_options(f, ActivationOptions, loading_horizon=0), recompute_blocks=drops)
        gpu = estimate_memory(w, f).gpu_peak
        kept = shape.layers - 1 - drops
        return gpu, gpu + kept * w.block_input_bytes + shape.layers * shape.layer_params * 2

    pooled = H100.gpu_bytes + H100.host_bytes + H100.disk_bytes

    def fits(seq):
        return any(
            gpu <= H100.gpu_bytes and total <= pooled for gpu, total in (alive(seq, d) for d in range(shape.layers - 1))
        )

    assert fits(physical) and not fits(physical + SEQ_STEP)
    # Without drops, storage stops the step earlier: recompute is what takes it further.
    gpu, total = alive(physical)
    assert gpu <= H100.gpu_bytes and total > pooled
    assert limit == "storage" and alive(physical + 8 * SEQ_STEP)[0] <= H100.gpu_bytes


def test_recompute_placement_drops_what_storage_cannot_hold():
    """Past what GPU, RAM and disk hold, block inputs are dropped and replayed from the kept
    input before them: evenly spread (runs of two), never block 0's or the last, counted in
    no storage, one more block forward each, and the replayed input on the GPU."""
    from offloadkit.planning import estimate_time
    from offloadkit.planning.memory import region_length

    budgets = Budgets(141 * GiB, 108 * GiB, 55 * GiB)
    p = plan("llama-3-8b", 15 << 16, lora_rank=16, budgets=budgets)  # 960K tokens
    assert p.fits, p.reasons
    dropped = [i for i, where in enumerate(p.placement) if where == "recompute"]
    assert dropped and 0 not in dropped and p.placement[-1] == "gpu"
    assert region_length(p.placement) == 2 and all(p.placement[i - 1] != "recompute" for i in dropped)
    assert p.to_config()["block_input_placement"] == tuple(p.placement)
    assert OffloadConfig.from_dict(p.to_config()).block_input_placement == tuple(p.placement)
    w, f = p.workload, p.options
    block = w.block_input_bytes
    assert p.memory.disk == p.placement.count("disk") * block
    assert p.memory.gpu_parts["replayed block inputs"] == block
    # Dropping fewer does not fit; the cost is one forward of the block before each drop.
    held, drops = input_counts(w, f)
    from offloadkit.planning.planner import _check, _placed

    fewer = _placed(w, f, budgets, held, drops - 1)
    assert _check(w, estimate_memory(w, fewer), budgets)
    in_ram = p.placement.count("ram") if "disk" in p.placement else None
    kept = estimate_time(w, place_inputs(w, f, held, 0, in_ram), budgets.rates, p.placement)
    s = w.shape
    one_forward = 2 * w.tokens * sum(a * b for a, b in s.linears) + 2 * w.tokens * s.lora_params(16) // s.layers
    attention = 2.0 * w.seq_len**2 * s.heads * s.head_dim
    assert p.time.flops - kept.flops == pytest.approx(len(dropped) * (one_forward + attention))
    # Where storage holds everything, nothing is dropped.
    assert "recompute" not in plan("llama-3-8b", 1 << 18, lora_rank=16, budgets=budgets).placement


def test_recompute_replaces_the_disk_where_a_replay_is_faster_than_a_read():
    from offloadkit.planning.timing import Rates

    slow = Budgets(40 * GiB, 20 * GiB, 200 * GiB, rates=Rates(disk_read_bytes_per_s=1e7, disk_write_bytes_per_s=1e7))
    p = plan("llama-3-8b", 1 << 17, lora_rank=16, budgets=slow)
    assert p.fits and "recompute" in p.placement and "disk" not in p.placement
    fast = Budgets(40 * GiB, 20 * GiB, 200 * GiB)
    q = plan("llama-3-8b", 1 << 17, lora_rank=16, budgets=fast)
    assert q.fits and "recompute" not in q.placement and "disk" in q.placement


def test_the_plan_table_names_the_dropped_inputs():
    p = plan("llama-3-8b", 1 << 20, lora_rank=16, budgets=Budgets(141 * GiB, 108 * GiB, 55 * GiB))
    assert "nowhere: replayed from the kept input before it" in p.table()
    # A run of k blocks holds the k - 1 inputs its replay recomputed until backward passes them.
    from offloadkit.planning.memory import region_length

    run = region_length(p.placement)
    assert run >= 2 and p.memory.gpu_parts["replayed block inputs"] == (run - 1) * p.workload.block_input_bytes


def test_capacity_reaches_nine_tenths_of_the_physical_limit_on_the_h100_budgets():
    cap = longest_sequence("llama-3-8b", lora_rank=16, budgets=H100)
    assert cap.ratio >= 0.9, cap.summary()
    p = cap.plan
    assert p.fits and p.memory.disk <= H100.disk_bytes and p.memory.gpu_reserved <= H100.gpu_bytes
    # At the edge nothing is fetched ahead: the horizon is 0, and the step time pays for each fetch.
    assert option(p.options, ActivationOptions).loading_horizon == 0
    assert p.to_config()["activation_loading_horizon"] == 0

    from offloadkit.planning import estimate_time

    ahead = estimate_time(
        p.workload, with_options(p.options, ActivationOptions, loading_horizon=1), H100.rates, p.placement
    )
    assert p.time.seconds > ahead.seconds
    # One more block input held on the GPU would not fit: that is why the horizon went to 0.
    held = estimate_memory(p.workload, with_options(p.options, ActivationOptions, loading_horizon=1))
    assert held.gpu_reserved > H100.gpu_bytes


@pytest.mark.parametrize("lora_rank", [0, 16])
def test_the_tiered_engine_keeps_in_ram_what_the_plan_places_there(tmp_path, monkeypatch, lora_rank):
    """The plan's RAM share, realised through the cap it hands the engine, holds exactly the
    block inputs it placed in RAM (the tiered tier keeps part of the cap free and demotes the
    oldest), and the rest goes to disk: no more than planned. With LoRA the streamed frozen
    weights share the budget, one pooled block per layer, as layer streaming holds them."""

    import offloadkit.storage.pool as pool_module
    from offloadkit.planning import ModelShape, estimate_time
    from offloadkit.planning.memory import disk_staging_bytes, final_norm_saves
    from offloadkit.planning.planner import Plan, _placed
    from offloadkit.storage import DiskOptions, HostBufferPool, HostMemoryBudget
    from offloadkit.storage.factory import build_tier

    hidden, seq = (1024, 2048) if not lora_rank else (512, 8192)  # 4 MiB / 8 MiB block inputs
    shape = ModelShape(
        hidden=hidden, intermediate=2 * hidden, layers=24, heads=8, kv_heads=8, head_dim=hidden // 8, vocab=1000
    )
    w = Workload(shape, seq, lora_rank=lora_rank)
    block = w.block_input_bytes
    layer_bytes = shape.layer_params * w.dtype_bytes  # 5 MiB of frozen weights per layer with LoRA
    # The growth chunk of the 8B shape at scale: its 416 MiB layers in 512 MiB chunks.
    monkeypatch.setattr(pool_module, "_MAX_CHUNK", layer_bytes * 512 // 416 // 4096 * 4096)
    streamed = shape.layers * layer_bytes if lora_rank else 0
    budgets = Budgets(80 * GiB, streamed + 20 * block, 1 * GiB)
    f = _placed(w, planned_options(w, offload_inputs=True, layer_streaming=bool(lora_rank)), budgets)
    m = estimate_memory(w, f)
    p = Plan(w, f, budgets, "offload", m, estimate_time(w, f, budgets.rates, m.block_placement), True)
    planned_ram, planned_disk = p.placement.count("ram"), p.placement.count("disk")
    assert planned_ram > 0 and planned_disk > 0
    staging = disk_staging_bytes(w, OptionSet(f), p.placement)
    assert p.host_budget_bytes() + staging <= budgets.host_bytes, "cap plus staging within the host budget"

    budget = HostMemoryBudget(limit_bytes=p.host_budget_bytes(), min_free_bytes=0)
    weights_pool = HostBufferPool(pin_memory=False, budget=budget, grow_in_chunks=False)  # as streaming does
    weights = [weights_pool.acquire(layer_bytes) for _ in range(shape.layers if lora_rank else 0)]
    assert all(weights), "the cap holds the streamed weights"
    tier = build_tier("tiered", budget, pin_memory=False, use_streams=False, disk=DiskOptions(directory=str(tmp_path)))
    # Each block input with its planned place, as checkpointing marks them.
    stored = [tier.store(torch.full((block,), i, dtype=torch.uint8), p.placement[i]) for i in range(shape.layers - 1)]
    # Then what the final norm and the head's input save, after the last block (unplaced).
    norm = [tier.store(torch.zeros(n, dtype=torch.uint8)) for n in final_norm_saves(w)]
    assert all(norm), "the final norm's saves have a place (RAM, or disk when a write is still under way)"
    for s in stored:  # let background demotions finish
        demotion = s.payload.demotion
        if demotion is not None and demotion.payload.write is not None:
            demotion.payload.write.result()
    in_ram = sum(s.payload.in_ram for s in stored)
    assert in_ram == planned_ram and len(stored) - in_ram == planned_disk
    assert [s.payload.in_ram for s in stored] == [x == "ram" for x in p.placement[:-1]], "oldest on disk"
    for s in [*stored, *norm]:
        tier.free(s)
    tier.close()
    for blk in weights:
        weights_pool.release(blk)


def test_physical_limit_keeps_frozen_weights_on_the_gpu_when_ram_cannot_hold_them():
    from offloadkit.planning import physical_limit

    roomy, _ = physical_limit("llama-3-8b", budgets=Budgets(80 * GiB, 64 * GiB, 200 * GiB))
    no_ram, _ = physical_limit("llama-3-8b", budgets=Budgets(80 * GiB, 1 * GiB, 200 * GiB))
    assert no_ram < roomy, "13 GiB of streamed weights cannot stream from 1 GiB of RAM"


def test_a_full_fine_tune_keeps_its_adamw_state_in_host_memory_when_that_fits_longer():
    """The 8B shape on an H100 with 108 GiB of RAM: with the AdamW state in host memory
    (updated at step() after the Trainer's clipping, every gradient held until then), the
    planner fits 384K tokens and more, the state counted in host RAM and its copies in the
    step; with the state and gradients on the GPU (45 GiB beside the weights), the same step
    does not fit."""
    budgets = Budgets(79 << 30, 108 << 30, 55 << 30)
    cap = longest_sequence("llama-3-8b", lora_rank=0, budgets=budgets)
    assert cap.longest >= 384 * 1024, cap.summary()
    chosen = cap.plan
    assert chosen.fits and option(chosen.options, OptimizerOptions).enabled
    keys = chosen.to_config()
    assert keys["optimizer_offloading"] is True and keys["optimizer_precision"] == "params"
    state = chosen.workload.shape.params * 4  # two bf16 moments
    assert chosen.memory.host >= state
    # Its state crosses the link both ways in backward: the predicted PCIe time counts it.
    assert chosen.time.pcie_s >= state / budgets.rates.pcie_bytes_per_s

    on_gpu = estimate_memory(chosen.workload, with_options(chosen.options, OptimizerOptions, enabled=False))
    assert on_gpu.gpu_reserved > budgets.gpu_bytes


def test_fp32_master_weights_cost_twelve_bytes_a_parameter_of_host_memory():
    budgets = Budgets(60 << 30, 108 << 30, 55 << 30)  # too small for the state on the GPU
    bf16 = plan("llama-3-8b", 16384, lora_rank=0, budgets=budgets)
    assert option(bf16.options, OptimizerOptions).enabled
    fp32 = plan("llama-3-8b", 16384, lora_rank=0, budgets=budgets, optimizer_precision="fp32_master")
    params = bf16.workload.shape.params
    assert option(fp32.options, OptimizerOptions).enabled and fp32.to_config()["optimizer_precision"] == "fp32_master"
    assert fp32.memory.host - bf16.memory.host == params * (12 - 4)
    assert "AdamW state (fp32_master, 12 bytes a parameter): host memory" in fp32.table()
    shorter = longest_sequence("llama-3-8b", lora_rank=0, budgets=budgets, optimizer_precision="fp32_master")
    assert shorter.longest < longest_sequence("llama-3-8b", lora_rank=0, budgets=budgets).longest
    compact = plan("llama-3-8b", 16384, lora_rank=0, budgets=budgets, optimizer_precision="compact")
    assert compact.memory.host == bf16.memory.host and "AdamW state (compact, 4 bytes a parameter)" in compact.table()
    # The compact update's fp32 temporaries: one chunk of 2**24 elements, 40 bytes each.
    extra = compact.memory.gpu_parts["trainable state"] - bf16.memory.gpu_parts["trainable state"]
    assert option(compact.options, OptimizerOptions).enabled and extra == (1 << 24) * 40
    with pytest.raises(ValueError, match="optimizer_precision='fp8' is not a precision; use one of params, fp32"):
        plan("llama-3-8b", 16384, lora_rank=0, budgets=budgets, optimizer_precision="fp8")


def test_without_room_in_host_memory_the_state_stays_on_the_gpu():
    """16 GiB of RAM cannot hold the 8B's 28 GB of moments: the plan keeps them on the GPU."""
    p = plan("llama-3-8b", 4096, lora_rank=0, budgets=Budgets(79 << 30, 16 << 30, 55 << 30))
    assert p.fits and not option(p.options, OptimizerOptions).enabled
    assert "AdamW state (params, 4 bytes a parameter): GPU" in p.table()


def test_lora_plans_never_offload_the_optimizer():
    p = plan("llama-3-8b", 16384, lora_rank=16, budgets=Budgets(79 << 30, 108 << 30, 55 << 30))
    assert not option(p.options, OptimizerOptions).enabled and p.to_config()["optimizer_offloading"] is False


def test_a_full_fine_tune_streams_its_weights_when_the_gpu_is_small():
    """8B full fine-tune at 16K, updated in backward (no clipping): on 79 GiB the weights stay
    on the GPU (as fast, less host RAM); on 16 GiB the plan streams the layers' weights with
    the state on the host, counts their host copies, and hands over the keys that turn it on.
    Under the Trainer's clipping the 15 GiB of gradients held until step() do not fit 16 GiB."""
    from offloadkit.planning import OptimizerSetup

    in_backward = OptimizerSetup(updates_in_backward=True)
    roomy = plan("llama-3-8b", 16384, lora_rank=0, budgets=Budgets(79 << 30, 108 << 30, 55 << 30))
    small = plan(
        "llama-3-8b", 16384, lora_rank=0, budgets=Budgets(16 << 30, 108 << 30, 55 << 30), optimizer=in_backward
    )
    assert roomy.fits and not option(roomy.options, StreamingOptions).enabled
    assert small.fits and option(small.options, StreamingOptions).enabled
    assert option(small.options, OptimizerOptions).enabled
    assert not plan("llama-3-8b", 16384, lora_rank=0, budgets=Budgets(16 << 30, 108 << 30, 55 << 30)).fits
    shape = small.workload.shape
    weights = shape.layers * shape.layer_params * 2
    assert small.memory.gpu_reserved <= 16 << 30
    edge = shape.embed_params + shape.head_params + shape.hidden
    assert small.memory.gpu_parts["weights"] == (edge + 2 * shape.layer_params) * 2  # two layers and the edges
    streamed = with_options(small.options, StreamingOptions, enabled=False)
    assert estimate_memory(small.workload, small.options).host - estimate_memory(small.workload, streamed).host == (
        weights
    )
    keys = small.to_config()
    assert keys["layer_offloading"] and keys["optimizer_offloading"]
    # Without the optimizer updating in backward, trainable weights never stream.
    state_on_gpu = with_options(small.options, OptimizerOptions, enabled=False)
    assert estimate_memory(small.workload, state_on_gpu).host < estimate_memory(small.workload, small.options).host


def test_attention_outputs_are_kept_for_the_layers_ram_holds():
    """At 64K the host holds every layer's attention output beside the block inputs; at 256K
    only some layers' (no disk for them); each kept layer saves its attention forward."""
    from offloadkit.planning.memory import attention_kept_bytes

    budgets = Budgets(80 * GiB, 108 * GiB, 55 * GiB)
    short = plan("llama-3-8b", 65536, lora_rank=16, budgets=budgets)
    assert (
        keeps_attention(short.workload, OptionSet(short.options)) == 32
        and short.to_config()["keep_attention_outputs"] is True
    )
    long = plan("llama-3-8b", 262144, lora_rank=16, budgets=budgets)
    kept = keeps_attention(long.workload, OptionSet(long.options))
    assert 0 < kept < 32 and long.to_config()["keep_attention_outputs"] == kept
    without = with_options(long.options, CheckpointOptions, keep_attention=False)
    m = estimate_memory(long.workload, without)
    assert long.memory.host - m.host == kept * attention_kept_bytes(long.workload)
    from offloadkit.planning import estimate_time

    t = estimate_time(long.workload, without, budgets.rates, m.block_placement)
    assert long.time.seconds < t.seconds and long.time.attention_flops < t.attention_flops
    # At the edge storage is short: nothing is kept.
    edge = longest_sequence("llama-3-8b", lora_rank=16, budgets=H100).plan
    assert keeps_attention(edge.workload, OptionSet(edge.options)) == 0


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_the_layer_linear_rate_counts_what_the_planner_counts(lora_rank):
    """``--measure`` times one layer's linear work; its FLOPs are the planner's own count for
    one layer (a one-layer step's linear FLOPs less the head's), so the measured rate
    converts back into the planner's time."""
    from offloadkit.planning.rates import layer_linear_flops, linear_rate
    from offloadkit.planning.timing import step_flops

    shape = resolve_shape("llama-3-8b").with_layers(1)
    shape = replace(shape, hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16, vocab=100)
    tokens = 32
    fwd, bwd, _, _ = step_flops(Workload(shape, tokens, lora_rank=lora_rank), (CheckpointOptions(enabled=False),))
    head = shape.vocab * shape.hidden * tokens * (2 + (4 if not lora_rank else 2))
    assert layer_linear_flops(shape, lora_rank, tokens) == fwd + bwd - head
    # What the probe runs is that count: PyTorch's own FLOP counter over its four runs (one
    # warm-up, three timed) finds exactly four layers' worth.
    from torch.utils.flop_counter import FlopCounterMode

    for fused in (False, True) if lora_rank else (False,):
        with FlopCounterMode(display=False) as counter:
            rate = linear_rate(shape, lora_rank, tokens=tokens, device="cpu", fused_lora=fused)
        assert counter.get_total_flops() == 4 * layer_linear_flops(shape, lora_rank, tokens), fused
        assert rate > 0


def test_a_fused_lora_plan_runs_its_linear_work_at_the_fused_rate():
    from offloadkit.planning.timing import FUSED_LORA_LINEAR_SPEEDUP, Rates, estimate_time

    w = Workload(resolve_shape("llama-3-8b"), 65536, lora_rank=16)
    chosen = dict(offload_inputs=True, loss_chunks=8, mlp_shards=4)
    f = place_inputs(w, planned_options(w, **chosen))
    with_fused = place_inputs(w, planned_options(w, fused_lora=True, **chosen))
    peft, fused = estimate_time(w, f, Rates(), ["ram"] * 31 + ["gpu"]), None
    fused = estimate_time(w, with_fused, Rates(), ["ram"] * 31 + ["gpu"])
    linear = peft.linear_flops / Rates().matmul_flops_per_s
    assert fused.compute_s == pytest.approx(peft.compute_s - linear + linear / FUSED_LORA_LINEAR_SPEEDUP)
    measured = Rates(fused_lora_matmul_flops_per_s=1e15)
    assert (
        measured.linear_flops_per_s(True) == 1e15 and measured.linear_flops_per_s(False) == Rates().matmul_flops_per_s
    )
    full = Workload(resolve_shape("llama-3-8b"), 65536, lora_rank=0)  # no adapters: nothing to fuse
    assert estimate_time(full, with_fused, Rates(), ["ram"] * 31 + ["gpu"]) == estimate_time(
        full, f, Rates(), ["ram"] * 31 + ["gpu"]
    )
