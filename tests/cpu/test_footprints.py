"""Each component's footprint is what the planner counts for it: the loss phase's parts are
the chunked loss's footprint, a layer's saved set and MLP temporaries hold the tiled MLP's,
the FLOPs the tiled projections add are its footprint's, and what head groups add to a layer's
backward is theirs."""

import itertools

import pytest

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import Footprint, OptionSet
from offloadkit.components import COMPONENTS
from offloadkit.longctx.component import CHUNKED_LOSS, HEAD_GROUPS, TILED_MLP
from offloadkit.parallel.component import CONTEXT_PARALLEL
from offloadkit.planning.memory import (
    Workload,
    estimate_memory,
    final_norm_bytes,
    layer_saved_bytes,
    tiles_final_norm,
)
from offloadkit.planning.parallelism import Parallelism
from offloadkit.planning.plan import place_inputs, planned_options, with_options
from offloadkit.planning.shape import resolve_shape
from offloadkit.planning.timing import step_flops

MODELS = ("llama-3-8b", "llama-3.2-1b")


def _workloads():
    for model, seq, lora, world in itertools.product(MODELS, (4096, 65536, 1 << 19), (0, 16), (1, 4)):
        parallel = Parallelism(world, context_parallel=True, ranks_per_host=world)
        yield Workload(resolve_shape(model), seq, lora_rank=lora, parallel=parallel)


def test_the_components_with_a_footprint_return_one():
    assert all(c.footprint is not None for c in COMPONENTS), [c.name for c in COMPONENTS if c.footprint is None]
    w = next(_workloads())
    for component in COMPONENTS:
        if component.footprint is not None:
            assert isinstance(component.footprint(w, OptionSet((CheckpointOptions(enabled=True),))), Footprint)


@pytest.mark.parametrize("chunks", [0, 1, 4, 32])
def test_the_loss_phase_is_the_final_norm_and_the_chunked_loss_footprint(chunks):
    seen = 0
    for w in _workloads():
        for tiled in (False, True):
            f = OptionSet(planned_options(w, loss_chunks=chunks, mlp_shards=8 if tiled else 1, tiled_projections=tiled))
            m = estimate_memory(w, f)
            if m.phase != "loss":
                continue
            seen += 1
            loss = {"final norm": final_norm_bytes(w, tiles_final_norm(f))} | CHUNKED_LOSS.footprint(w, f).loss
            assert {k: m.gpu_parts[k] for k in loss} == loss
            fixed = {k: v for k, v in m.gpu_parts.items() if k not in loss}
            assert m.gpu_peak == sum(fixed.values()) + sum(loss.values())
    assert seen


@pytest.mark.parametrize("shards", [1, 4])
@pytest.mark.parametrize("tiled_projections", [False, True])
def test_a_layer_holds_the_tiled_mlp_footprint(shards, tiled_projections):
    seen = 0
    for w in _workloads():
        f = OptionSet(planned_options(w, loss_chunks=16, mlp_shards=shards, tiled_projections=tiled_projections))
        mlp = TILED_MLP.footprint(w, f)
        # The rest of the layer's saved set does not depend on how the MLP is tiled.
        rest = layer_saved_bytes(w, shards, tiled_projections) - mlp.layer_saved
        untiled = OptionSet(planned_options(w, loss_chunks=16, tiled_projections=tiled_projections))
        assert rest == layer_saved_bytes(w, 1, tiled_projections) - TILED_MLP.footprint(w, untiled).layer_saved
        # Without checkpointing every layer holds its saved set all step.
        whole = estimate_memory(w, with_options(f.options, CheckpointOptions, enabled=False))
        layers, block = w.shape.layers, w.block_input_bytes
        assert whole.gpu_parts["activations"] == layers * (rest + mlp.layer_saved + block)
        # Under checkpointing one layer's recompute holds it, and its backward the larger of
        # the MLP's temporaries and attention's.
        m = estimate_memory(w, f)
        if m.phase == "layer backward":
            seen += 1
            assert m.gpu_parts["layer recompute"] == rest + mlp.layer_saved
            assert m.gpu_parts["layer backward"] >= mlp.mlp_backward
    assert seen


def test_the_mlp_backward_is_the_layer_backward_where_it_is_the_larger():
    w = Workload(resolve_shape("llama-3-8b"), 1 << 18, lora_rank=16)
    f = OptionSet(planned_options(w, loss_chunks=16))
    m = estimate_memory(w, f)
    assert m.phase == "layer backward"
    assert m.gpu_parts["layer backward"] == TILED_MLP.footprint(w, f).mlp_backward


def test_the_tiled_projections_flops_are_the_tiled_mlp_footprint():
    for w in _workloads():
        for checkpointing in (True, False):
            base = OptionSet(with_options(planned_options(w, mlp_shards=4), CheckpointOptions, enabled=checkpointing))
            tiled = OptionSet(
                with_options(
                    planned_options(w, mlp_shards=4, tiled_projections=True), CheckpointOptions, enabled=checkpointing
                )
            )
            added = step_flops(w, tiled)[1] - step_flops(w, base)[1]
            assert added == TILED_MLP.footprint(w, tiled).backward_flops
            assert TILED_MLP.footprint(w, base).backward_flops == 0


@pytest.mark.parametrize("groups", [2, 4, 8])
def test_head_groups_add_their_footprint_to_a_layers_backward(groups):
    from offloadkit.planning.memory import _own_attention_backward_bytes, layer_phase

    for w in _workloads():
        for shards, tiled in ((1, False), (4, False), (16, True)):
            chosen = dict(mlp_shards=shards, tiled_projections=tiled, rotation="alltoall")
            f = OptionSet(planned_options(w, head_groups=groups, **chosen))
            assert HEAD_GROUPS.footprint(w, OptionSet(planned_options(w, **chosen))) == Footprint()
            heads = HEAD_GROUPS.footprint(w, f)
            mlp = TILED_MLP.footprint(w, f).mlp_backward
            attention = _own_attention_backward_bytes(w, tiled)
            phase = layer_phase(w, f)
            assert phase["layer backward"] == max(mlp + heads.mlp_backward, attention + heads.attention_backward)
            # Ring attention's buffers, held beside attention only, show as a part of their own.
            ring = CONTEXT_PARALLEL.footprint(w, f).attention_backward
            raised = max(mlp + heads.mlp_backward, attention + heads.attention_backward + ring)
            assert phase.get("ring attention buffers", 0) == raised - phase["layer backward"]
            assert bool(ring) == w.parallel.splits_sequence


def _options_grid(w: Workload):
    for offload, streaming, optimizer, ram, recompute, keep, groups in itertools.product(
        (False, True), (False, True), (False, True), (None, 2), (0, 5), (0, 2), (1, 4)
    ):
        c = planned_options(
            w,
            offload_inputs=offload,
            layer_streaming=streaming,
            optimizer_offloading=optimizer,
            head_groups=groups,
            loss_chunks=8,
        )
        c = place_inputs(w, c, recompute_blocks=recompute, ram_blocks=ram)
        yield with_options(c, CheckpointOptions, keep_attention=keep or False)


def test_the_estimate_is_the_models_own_bytes_plus_every_footprint():
    """Host RAM and disk are the footprints' sums; every GPU part a footprint names is the
    estimate's (the fixed ones always, a phase's when it is the peak's)."""
    from offloadkit.planning.memory import HOST_BASELINE_BYTES, footprints

    for w in itertools.islice(_workloads(), 0, None, 3):
        for f in _options_grid(w):
            m = estimate_memory(w, f)
            prints = [p for _, p in footprints(w, f)]
            assert [name for name, _ in footprints(w, f)][2:] == [c.name for c in COMPONENTS]
            assert m.host == HOST_BASELINE_BYTES + sum(sum(p.host.values()) for p in prints)
            assert m.host_parts["process baseline"] == HOST_BASELINE_BYTES
            assert m.disk == sum(p.disk for p in prints)
            for p in prints:
                assert {k: m.gpu_parts[k] for k in p.gpu} == p.gpu
                phase = p.loss if m.phase == "loss" else p.layer
                assert {k: m.gpu_parts[k] for k in phase} == phase


def test_each_component_states_what_it_holds_where():
    """The parts each footprint names: a run that streams, offloads to RAM and disk, drops
    inputs, keeps attention outputs and offloads the optimizer's state shows each once."""
    from offloadkit.planning.memory import footprints

    w = Workload(resolve_shape("llama-3-8b"), 65536, lora_rank=0, updates_in_backward=True)
    f = planned_options(w, offload_inputs=True, layer_streaming=True, optimizer_offloading=True, loss_chunks=8)
    f = with_options(place_inputs(w, f, recompute_blocks=6, ram_blocks=10), CheckpointOptions, keep_attention=2)
    named = {name: p for name, p in footprints(w, f)}
    assert set(named["layer_streaming"].gpu) == {"weights"} and set(named["layer_streaming"].host) == {
        "streamed layers"
    }
    assert set(named["optimizer"].host) == {"optimizer state"}
    assert set(named["host_budget"].host) == {"block inputs in RAM", "disk staging"} and named["host_budget"].disk > 0
    assert set(named["activations"].gpu) == {"block inputs"}
    assert set(named["checkpointing"].layer) == {"replayed block inputs"}
    assert set(named["checkpointing"].host) == {"kept attention outputs"}
    m = estimate_memory(w, f)
    assert m.host_parts["streamed layers"] == w.shape.layers * w.shape.layer_params * w.dtype_bytes
