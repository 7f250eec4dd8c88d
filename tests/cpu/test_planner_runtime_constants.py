"""The planner predicts what the runtime does: each figure it takes from the runtime (prefetch
horizons, loss chunks, MLP shards, the disk tier's writes in flight, the tiered tier's reserve,
BackwardAdamW's copy window, state bytes and compact chunk, the streaming depth) is checked
here against the runtime as it is built, not against a shared constant: a change on either
side alone fails here."""

from __future__ import annotations

import inspect
import math
from dataclasses import replace

import pytest
import torch

from offloadkit.component import OptionSet
from offloadkit.defaults import COMPACT_CHUNK_BYTES_PER_ELEMENT
from offloadkit.engine.options import ActivationOptions
from offloadkit.layers.options import StreamingOptions
from offloadkit.longctx.footprint import tiled_mlp_shards
from offloadkit.planning import Budgets, Workload, estimate_memory, plan, resolve_shape
from offloadkit.planning.memory import (
    auto_loss_chunks,
    auto_mlp_shards,
    disk_staging_bytes,
    tiered_reserve_bytes,
    tiles_projections,
)
from offloadkit.planning.plan import option, place_inputs, planned_options, with_options

GiB = 1 << 30
EIGHT_B = resolve_shape("llama-3-8b")


# -- the engine's prefetch horizon ----------------------------------------------------------


def _manager(storage: str, tmp_path, **kwargs):
    from offloadkit import get_act_offloading_ctx_manager
    from offloadkit.storage import DiskOptions

    disk = DiskOptions(directory=str(tmp_path)) if storage != "ram" else None
    return get_act_offloading_ctx_manager(
        torch.nn.Linear(4, 4),
        warn_if_no_head=False,
        use_pin_memory=False,
        use_streams=False,
        offload_cpu_tensors=True,
        storage=storage,
        disk=disk,
        **kwargs,
    )


@pytest.mark.parametrize(
    "storage, ram_blocks",
    [("ram", None), ("disk", 0), ("tiered", 12)],
    ids=["ram", "disk", "ram-then-disk"],
)
def test_the_planned_horizon_is_the_engines_default(tmp_path, storage, ram_blocks):
    """A plan without a horizon (``activation_loading_horizon`` unset) predicts what the
    engine's default fetches ahead: the same bytes as the horizon the engine picks for the
    tier the placement needs."""
    manager = _manager(storage, tmp_path)
    try:
        runtime = manager.prefetch
    finally:
        manager.close()
    w = Workload(EIGHT_B, 16384)
    f = place_inputs(w, planned_options(w, offload_inputs=True, loss_chunks=8), ram_blocks=ram_blocks)
    default = estimate_memory(w, f)
    assert ("disk" in default.block_placement) == (storage != "ram")
    assert ("ram" in default.block_placement) == (storage != "disk")
    explicit = estimate_memory(w, with_options(f, ActivationOptions, loading_horizon=runtime))
    assert (default.gpu_peak, default.host) == (explicit.gpu_peak, explicit.host), runtime
    # The horizon counts: one more or one less would change the figures.
    other = estimate_memory(w, with_options(f, ActivationOptions, loading_horizon=runtime + 1))
    assert other.gpu_peak != default.gpu_peak


# -- the automatic tiling of offloadkit.longctx --------------------------------------------


def _tiled_calls(monkeypatch):
    """Record the shard count of every tiled call (nothing is computed)."""
    from offloadkit.longctx import tiled_mlp

    calls = []

    def record(fn, inputs, num_shards, params):
        calls.append(num_shards)
        return inputs[0]

    monkeypatch.setattr(tiled_mlp, "tiled_forward", record)
    return calls


@pytest.mark.parametrize("tokens", [4096, 16384, 18725, 65536, 65537, 131072, 524288, 1 << 20])
def test_mlp_shards_are_the_tiled_mlps(monkeypatch, tokens):
    """The planner's MLP shards and its switch to tiled projections are the shard counts the
    tiled modules of a Llama-3-8B layer choose (a model on the meta device: nothing runs)."""
    pytest.importorskip("transformers")
    from offloadkit.longctx import apply_tiled_mlp
    from offloadkit.models.zoo import build_llama

    model = build_llama("llama-3-8b", device="meta", num_hidden_layers=1)
    handle = apply_tiled_mlp(model, projections=True)
    layer = model.model.layers[0]
    calls = _tiled_calls(monkeypatch)
    x = torch.empty(1, tokens, EIGHT_B.hidden, device="meta")
    with torch.no_grad():
        layer.mlp(x)
        mlp = calls[-1] if calls else 1
        calls.clear()
        layer.input_layernorm(x)
        norm = calls[-1] if calls else 1
        calls.clear()
        layer.self_attn.q_proj(x)
        q = calls[-1] if calls else 1
    handle.remove()
    assert auto_mlp_shards(tokens, EIGHT_B.intermediate) == mlp
    assert auto_mlp_shards(tokens, EIGHT_B.hidden) == norm == q
    assert tiles_projections(tokens, EIGHT_B.hidden) == (norm > 1)
    # A plan tiles as the runtime's automatic count does.
    p = plan("llama-3-8b", tokens, budgets=Budgets(1 << 50, 1 << 50, 1 << 50))
    assert tiled_mlp_shards(OptionSet(p.options)) in (1, mlp)


@pytest.mark.parametrize("tokens", [1, 2092, 2093, 16384, 131072, 1 << 20])
@pytest.mark.parametrize("vocab", [256, 32000, 128256, 151936])
def test_loss_chunks_are_the_chunked_losss(monkeypatch, tokens, vocab):
    """The planner's chunk count is how many chunks :func:`chunked_cross_entropy` runs in
    automatic mode for that many tokens and that vocabulary."""
    from offloadkit.longctx import loss

    seen = []

    def record(hidden, weight, bias, labels, token_weight, denom, opts):
        seen.append((hidden.shape[0], opts[0]))
        return hidden.sum()

    monkeypatch.setattr(loss._ChunkedCrossEntropy, "apply", record)
    hidden = torch.zeros(tokens, 1)
    loss.chunked_cross_entropy(hidden, torch.zeros(vocab, 1), torch.zeros(tokens, dtype=torch.long))
    (n, chunk_tokens) = seen[0]
    assert auto_loss_chunks(tokens, vocab) == len(range(0, n, chunk_tokens)) == math.ceil(n / chunk_tokens)


@pytest.mark.parametrize("wanted", [1, 2, 3, 5, 6, 8, 32])
@pytest.mark.parametrize("kv_heads", [1, 4, 6, 8])
def test_head_groups_are_the_groups_attention_runs_in(monkeypatch, wanted, kv_heads):
    """The planner's attention workspace is counted for as many key/value head groups as
    :func:`grouped_attention` runs SDPA calls (the one rule lives in longctx)."""
    from offloadkit.longctx import attention_groups

    real = attention_groups.SDPA  # PyTorch's own function, which the groups call
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[1].shape[1])  # key/value heads of this call
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_groups, "SDPA", counting)
    q, k, v = (torch.randn(1, heads, 8, 4) for heads in (2 * kv_heads, kv_heads, kv_heads))
    out = attention_groups.grouped_attention(wanted, q, k, v, is_causal=True, enable_gqa=True)
    ran = len(calls) if out is not None else 1
    assert sum(calls) == (kv_heads if out is not None else 0)
    from offloadkit.planning.memory import layer_phase

    w = Workload(replace(EIGHT_B, heads=2 * kv_heads, kv_heads=kv_heads), 65536)

    def layer_backward(groups: int) -> int:
        f = planned_options(w, mlp_shards=16, tiled_projections=True, head_groups=groups)
        return layer_phase(w, f)["layer backward"]

    assert layer_backward(wanted) == layer_backward(ran)
    if ran > 1:  # grouping shows in the estimate: the rule is not idle here
        assert layer_backward(wanted) != layer_backward(1)


# -- the storage tiers ---------------------------------------------------------------------


def test_disk_staging_is_the_disk_tiers_writes_in_flight(tmp_path):
    """With every block input on disk, forward stages the writes the disk tier lets queue."""
    from offloadkit.storage import DiskOptions, HostMemoryBudget
    from offloadkit.storage.factory import build_tier

    tier = build_tier(
        "disk", HostMemoryBudget(), pin_memory=False, use_streams=False, disk=DiskOptions(directory=str(tmp_path))
    )
    try:
        runtime = tier.options.max_inflight_bytes
    finally:
        tier.close()
    w = Workload(resolve_shape("tiny"), 512)
    f = place_inputs(w, planned_options(w, offload_inputs=True), ram_blocks=0)
    placement = estimate_memory(w, f).block_placement
    assert "ram" not in placement and "disk" in placement
    assert 8 * w.block_input_bytes < runtime  # the block inputs read ahead stage less
    assert disk_staging_bytes(w, OptionSet(f), placement) == runtime


@pytest.mark.parametrize("base", [1 << 20, 100 << 20, 1 << 30, (1536 << 20) + 5, 3 << 30, 40 << 30])
def test_the_room_the_plan_leaves_is_the_tiered_tiers_reserve(tmp_path, base):
    """The cap a plan hands the tiered tier is its RAM share plus the room the tier keeps free
    under that cap: the tier built with that cap keeps exactly that room (a quarter of the cap
    for small caps, a fixed reserve for large ones)."""
    from offloadkit.storage import DiskOptions, HostMemoryBudget
    from offloadkit.storage.factory import build_tier

    room = tiered_reserve_bytes(base)
    budget = HostMemoryBudget(limit_bytes=base + room, min_free_bytes=0)
    tier = build_tier("tiered", budget, pin_memory=False, use_streams=False, disk=DiskOptions(directory=str(tmp_path)))
    try:
        assert tier.reserve_bytes == room
    finally:
        tier.close()


def test_a_spilling_plans_cap_realises_its_ram_share(tmp_path):
    """End to end: the engine built from a spilling plan's ``host_budget_bytes`` (tiered)
    fetches ahead as the plan assumed and keeps the room the plan left free."""
    from offloadkit.planning.planner import _streamed_host_bytes
    from offloadkit.storage.pool import size_class

    p = plan("llama-3-8b", 131072, budgets=Budgets(40 * GiB, 20 * GiB, 500 * GiB))
    config = p.to_config()
    assert config["activation_offloading"] == "disk" and config["disk_tiering"], config
    # The RAM share: the block inputs placed in RAM and the streamed layers, which share the cap.
    ram = p.placement.count("ram") * size_class(p.workload.block_input_bytes)
    ram += _streamed_host_bytes(p.workload, OptionSet(p.options))
    manager = _manager("tiered", tmp_path, host_budget_bytes=config["host_budget_bytes"])
    try:
        assert manager.tier.reserve_bytes == config["host_budget_bytes"] - ram
        asked = option(p.options, ActivationOptions).loading_horizon
        horizon = asked if asked is not None else manager.prefetch
    finally:
        manager.close()
    fetched = with_options(p.options, ActivationOptions, loading_horizon=horizon)
    assert estimate_memory(p.workload, fetched).gpu_peak == p.memory.gpu_peak


# -- BackwardAdamW -------------------------------------------------------------------------


def _optimizer(precision: str):
    from offloadkit.optim import BackwardAdamW

    p = torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16))
    return p, BackwardAdamW.for_precision([p], precision, lr=1e-3)


@pytest.mark.parametrize("precision", ["params", "fp32_master", "compact"])
def test_the_planned_copy_window_is_backward_adamws_default(precision):
    _, opt = _optimizer(precision)
    runtime = opt._copies.window_bytes
    w = Workload(EIGHT_B, 4096, lora_rank=0, optimizer_precision=precision, updates_in_backward=True)
    f = planned_options(w, optimizer_offloading=True, loss_chunks=2)
    default = estimate_memory(w, f).gpu_parts["trainable state"]
    assert default == estimate_memory(replace(w, copy_window_bytes=runtime), f).gpu_parts["trainable state"]
    assert default != estimate_memory(replace(w, copy_window_bytes=runtime // 2), f).gpu_parts["trainable state"]


def test_the_planned_compact_chunk_is_backward_adamws():
    """The compact update widens one chunk to fp32 at a time: the planner counts the chunk
    BackwardAdamW uses (8B: the embedding is far larger than a chunk)."""
    _, opt = _optimizer("compact")
    w = Workload(EIGHT_B, 4096, lora_rank=0, optimizer_precision="compact", updates_in_backward=True)
    plain = replace(w, optimizer_precision="params")
    assert w.optimizer_state_bytes == plain.optimizer_state_bytes
    f = planned_options(w, optimizer_offloading=True, loss_chunks=2)
    w, plain = (replace(x, copy_window_bytes=GiB) for x in (w, plain))
    extra = estimate_memory(w, f).gpu_parts["trainable state"] - estimate_memory(plain, f).gpu_parts["trainable state"]
    largest = max(max(a * c for a, c in EIGHT_B.linears), EIGHT_B.embed_params, EIGHT_B.head_params)
    assert largest > opt.chunk_elements
    assert extra == opt.chunk_elements * COMPACT_CHUNK_BYTES_PER_ELEMENT


@pytest.mark.parametrize("precision", ["params", "fp32_master", "compact"])
def test_the_planned_state_bytes_are_backward_adamws(precision):
    """Bytes of host state a bf16 parameter gets, once updated."""
    p, opt = _optimizer(precision)
    (p.float() ** 2).sum().backward()  # updated in backward: the state is made
    opt.step()
    state = opt.state[p]
    held = sum(t.nbytes for k, t in state.items() if torch.is_tensor(t) and t.numel() == p.numel())
    w = Workload(EIGHT_B, 4096, lora_rank=0, optimizer_precision=precision)
    assert held == w.optimizer_state_bytes * p.numel(), sorted(state)


# -- layer streaming -----------------------------------------------------------------------


def test_the_planned_stream_depth_is_layer_streamings_default():
    from offloadkit.layers.apply import apply_layer_streaming
    from offloadkit.layers.streaming import LayerStreamer

    runtime = inspect.signature(apply_layer_streaming).parameters["depth"].default
    assert inspect.signature(LayerStreamer).parameters["depth"].default == runtime
    assert StreamingOptions().depth == runtime
    assert inspect.signature(planned_options).parameters["stream_depth"].default == runtime
    assert inspect.signature(plan).parameters["stream_depth"].default == runtime
