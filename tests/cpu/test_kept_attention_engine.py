"""Kept attention outputs are the engine's: decided by its rule (``decide_output``), held as
entries of the block's forward and group (its stats count them), fetched back by the prefetch
scheduler ahead of the recompute's attention call, freed by its lifetime when the graph dies,
and refused by its storage (the kernel then runs again)."""

import gc

import pytest
import torch

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.engine.decide import decide_output
from offloadkit.engine.policy import OffloadPolicy
from offloadkit.runtime.attention_ops import AttentionCalls
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch, run_step
from tests.cpu.test_kept_attention import LAYERS, _CountKernels, _model

OUTPUTS = 2 * LAYERS  # an output and its log-sum-exp per layer


def _apply(model, keep=True, **kw):
    return apply_activation_checkpointing(
        model, offload_inputs=True, offload_cpu_tensors=True, keep_attention=keep, **kw
    )


def _forward(model):
    batch = make_batch(256, 2, 64)
    return model(input_ids=batch["input_ids"], labels=batch["labels"])


def _record_saves(offloader):
    """The entries the engine holds kept outputs in (None: not kept), in forward order; not
    their handles, whose going is what frees them."""
    saved = []
    save = offloader.save_for_recompute

    def recording(t):
        handle = save(t)
        saved.append(handle.entry.resolve()[0] if handle is not None else None)
        return handle

    offloader.save_for_recompute = recording
    return saved


def test_the_rule_is_the_engines():
    policy = OffloadPolicy(min_offload_size=1024, device_types=("cpu",))
    big, small = torch.zeros(1024), torch.zeros(8)
    assert decide_output(big, policy, closed=False).offload
    assert decide_output(small, policy, closed=False).reason == "small"
    assert decide_output(big, policy, closed=True).reason == "closed"
    assert decide_output(big, OffloadPolicy(1024, ("cuda",)), closed=False).reason == "device"
    # A block placed on the GPU keeps its input there, not its outputs; ram and disk are honoured.
    assert decide_output(big, policy, closed=False, placed="gpu").where is None
    assert decide_output(big, policy, closed=False, placed="disk").where == "disk"


def test_kept_outputs_are_entries_of_the_blocks_group():
    sizes = {}
    for keep in (False, True):
        model = _model()
        handle = _apply(model, keep)
        saved = _record_saves(handle.offloader)
        out = _forward(model)
        shared = handle.offloader._shared
        sizes[keep] = len(shared.entries), shared.stats.offloaded_tensors
        if keep:
            assert len(saved) == OUTPUTS and all(s is not None for s in saved)
            entries = saved
            assert all(e in shared.entries for e in entries)
            assert shared.stats.recompute_outputs == OUTPUTS and shared.stats.saved_tensors > 0
            steps = {e.step for e in shared.entries}
            assert len(steps) == 1  # one forward: the block inputs' step
            # Each checkpointed block's outputs share its input's group (the last block's
            # input stays on the device, and its outputs have no group).
            for block in range(LAYERS - 1):
                group = entries[2 * block].group
                assert group is not None and entries[2 * block + 1].group == group
                assert any(e.group == group and e not in entries for e in shared.entries)
        del out
        handle.remove()
    assert sizes[True][0] == sizes[False][0] + OUTPUTS
    assert sizes[True][1] == sizes[False][1] + OUTPUTS


def test_the_adaptive_window_counts_what_the_look_ahead_fetches():
    """The default prefetch window is 1/16 of what backward brings back ahead: kept outputs,
    fetched with their block's recompute, do not widen it (counted, they doubled it: two more
    block inputs ahead, 0.24 GiB more at the peak of an 8B step at 16K)."""
    windows = {}
    for keep in (False, True):
        model = _model()
        handle = _apply(model, keep, prefetch_bytes=None)  # the window prepare() builds
        out = _forward(model)
        shared = handle.offloader._shared
        (step,) = {e.step for e in shared.entries}
        inputs = sum(e.nbytes for e in step.by_seq.values() if not e.for_recompute)
        outputs = sum(e.nbytes for e in step.by_seq.values() if e.for_recompute)
        assert (outputs > 0) is keep
        out.loss.backward()
        windows[keep] = step.window_bytes
        assert step.window_bytes == inputs // 16 > 0
        handle.remove()
    assert windows[True] == windows[False]


def test_the_scheduler_fetches_them_as_their_blocks_recompute_begins_before_the_blocks_ahead():
    """From the second step (the order of use learned), every kept output is fetched by the
    scheduler before the recompute asks for it, as its block's recompute begins (its input
    unpacked), ahead of the copies the look-ahead then queues for blocks further on (on one
    copy stream the recompute's attention would wait behind those), and never while another
    block's outputs wait on the device: one block's at a time, as the recompute holds them."""
    model = _model()
    handle = _apply(model)
    offloader = handle.offloader
    saved = _record_saves(offloader)
    lane = offloader._shared.lane
    events, taken, outputs_resident, taken_seqs = [], [], [], set()
    fetch = lane.fetch

    def fetching(entry):
        if entry.for_recompute:
            # Outputs of another block, on the device and not yet taken by its recompute.
            waiting = {
                e.group for e in saved if e.gpu is not None and e.group != entry.group and e.seq not in taken_seqs
            }
            outputs_resident.append(waiting)
        events.append(("fetch", entry))
        fetch(entry)

    lane.fetch = fetching
    backward = offloader._backward
    unpack = backward.unpack

    def unpacking(packed):
        entry = packed.entry.resolve()[0] if hasattr(packed, "entry") else None
        if entry is not None and not entry.for_recompute:
            events.append(("unpack", entry.group))
        return unpack(packed)

    backward.unpack = unpacking
    planner = offloader._shared.planner
    consumed = planner.on_consumed

    def consuming(step, entry):
        taken_seqs.add(entry.seq)
        return consumed(step, entry)

    planner.on_consumed = consuming
    restore = offloader.restore_for_recompute

    def taking(h):
        entry = h.entry.resolve()[0]
        taken.append((entry, any(e is entry for kind, e in events if kind == "fetch"), entry.gpu is not None))
        return restore(h)

    offloader.restore_for_recompute = taking
    counter = _CountKernels()
    batch = make_batch(256, 2, 64)
    run_step(model, batch)  # learns the order of use
    for record in (events, taken, outputs_resident, saved, taken_seqs):
        record.clear()
    with AttentionCalls(counter):
        run_step(model, batch)
    assert counter.runs == LAYERS and handle.attention_stats.replayed == 2 * LAYERS
    assert len(taken) == OUTPUTS and {e for e, _, _ in taken} == set(saved)
    # Every one was queued by the scheduler and is on the device when asked for.
    assert all(was_fetched and resident for _, was_fetched, resident in taken), taken
    assert len(outputs_resident) == OUTPUTS and not any(outputs_resident), outputs_resident
    # Each block's outputs are the first copies queued after its input is unpacked: nothing
    # of another block (the look-ahead's) goes on the stream between.
    # (The last block's input stays on the device, unpacked from no storage: its outputs, of no
    # group, come at its recompute's start, first in backward.)
    checked = 0
    for i, (kind, entry) in enumerate(events):
        if kind != "fetch" or not entry.for_recompute or entry.group is None:
            continue
        checked += 1
        last = max(j for j in range(i) if events[j][0] == "unpack")
        assert events[last][1] == entry.group, events[last : i + 1]
        between = [e for k, e in events[last + 1 : i] if k == "fetch"]
        assert all(e.group == entry.group for e in between), (entry.group, [e.group for e in between])
    assert checked == OUTPUTS - 2
    handle.remove()


def test_a_graph_dropped_without_backward_frees_them():
    model = _model()
    handle = _apply(model)
    saved = _record_saves(handle.offloader)
    out = _forward(model)
    assert len(saved) == OUTPUTS and not any(e.released for e in saved)
    del out
    gc.collect()
    handle.offloader.drain()
    assert all(e.released for e in saved)
    assert handle.offloader.is_idle() and handle.offloader.tier.host_bytes_in_use() == 0
    handle.remove()


def test_replayed_outputs_are_freed_as_the_recompute_ends():
    model = _model()
    handle = _apply(model)
    saved = _record_saves(handle.offloader)
    run_step(model, make_batch(256, 2, 64))
    assert len(saved) == OUTPUTS and all(e.released for e in saved)
    assert handle.offloader.is_idle()
    handle.remove()


def test_a_refused_output_runs_the_kernel_and_gives_the_rest_back():
    """The storage refuses each log-sum-exp (the second output): the call's output already
    held goes back, and the recompute runs the kernel, gradients those of the full recompute."""
    model = _model()
    handle = _apply(model)
    offloader = handle.offloader
    tier = offloader.tier
    store = tier.store
    refusing = {"on": False}
    outputs = _record_saves(offloader)
    save = offloader.save_for_recompute

    def save_refusing_the_second(t):
        refusing["on"] = len(outputs) % 2 == 1
        try:
            return save(t)
        finally:
            refusing["on"] = False

    tier.store = lambda src, *a: None if refusing["on"] else store(src, *a)
    offloader.save_for_recompute = save_refusing_the_second
    counter = _CountKernels()
    with AttentionCalls(counter):
        got = run_step(model, make_batch(256, 2, 64))
    stats = handle.attention_stats
    assert outputs[1::2] == [None] * LAYERS and all(h is not None for h in outputs[::2])
    assert (stats.kept, stats.replayed, stats.ran_again) == (0, 0, LAYERS) and counter.runs == 2 * LAYERS
    assert all(e.released for e in outputs[::2])
    handle.remove()
    model = _model()
    ref_handle = _apply(model, keep=False)
    ref = run_step(model, make_batch(256, 2, 64))
    assert_bitwise_equal(ref[1], got[1], "grads")
    ref_handle.remove()


def test_small_outputs_stay_where_they_are():
    """Under the engine's threshold an output is held as it is, and still replayed."""
    model = _model()
    handle = _apply(model, min_offload_size=1 << 30)
    counter = _CountKernels()
    with AttentionCalls(counter):
        run_step(model, make_batch(256, 2, 64))
    stats = handle.attention_stats
    assert (stats.kept, stats.replayed, stats.kept_bytes) == (LAYERS, LAYERS, 0) and counter.runs == LAYERS
    engine = handle.offloader.stats
    assert engine.recompute_outputs == OUTPUTS and engine.offloaded_tensors == 0
    assert engine.kept_by_reason["small"] >= OUTPUTS
    handle.remove()


@pytest.mark.parametrize("storage", ["ram", "disk"])
def test_a_second_recompute_runs_the_kernel(storage, tmp_path):
    """Replayed copies are spent: a graph backpropagated twice runs the kernel the second time."""
    from offloadkit.storage.disk import DiskOptions

    model = _model()
    extra = {"disk": DiskOptions(directory=str(tmp_path))} if storage == "disk" else {}
    handle = _apply(model, storage=storage, **extra)
    out = _forward(model)
    out.loss.backward(retain_graph=True)
    out.loss.backward()
    stats = handle.attention_stats
    assert (stats.kept, stats.replayed, stats.ran_again) == (LAYERS, LAYERS, LAYERS)
    del out
    handle.remove()


@pytest.mark.parametrize("unused", ["ran-again", "refused-in-part"])
def test_outputs_left_unused_keep_the_learned_order(unused):
    """A layer whose recompute calls its kernel with other arguments leaves its kept outputs
    unused, and a kernel whose log-sum-exp storage refuses gives its output back in forward:
    the saved tensors' order of use is still learned and replayed every step after the first."""
    model = _model()
    handle = _apply(model)
    offloader = handle.offloader
    if unused == "ran-again":
        attn = model.model.layers[1].self_attn
        forward, calls = attn.forward, [0]

        def other_scale_in_recompute(*args, **kwargs):
            calls[0] += 1
            scaling = attn.scaling
            if calls[0] % 2 == 0:
                attn.scaling = scaling * 0.5
            try:
                return forward(*args, **kwargs)
            finally:
                attn.scaling = scaling

        attn.forward = other_scale_in_recompute
    else:
        tier, save = offloader.tier, offloader.save_for_recompute
        store, saves, refusing = tier.store, [0], [False]

        def every_second_refused(t):
            saves[0] += 1
            refusing[0] = saves[0] % 2 == 0
            try:
                return save(t)
            finally:
                refusing[0] = False

        tier.store = lambda src, *a: None if refusing[0] else store(src, *a)
        offloader.save_for_recompute = every_second_refused
    batch = make_batch(256, 2, 64)
    for _ in range(4):
        run_step(model, batch)
    assert offloader.stats.replayed_passes == 3 and offloader.stats.prefetch_misses == 0, offloader.stats
    assert handle.attention_stats.ran_again > 0
    handle.remove()


def test_a_step_keeping_fewer_outputs_replays_the_learned_order_of_its_saved_tensors():
    """Storage refuses a layer's outputs outright every other step (no entry for them): the
    saved tensors' entries are then numbered differently from the step the order was learned
    on, and the order, kept by rank among saved tensors, still names each of them."""
    torch.manual_seed(0)
    model = build_llama("tiny", num_hidden_layers=8, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    handle = _apply(model)
    offloader = handle.offloader
    tier, save = offloader.tier, offloader.save_for_recompute
    store, refusing, saves = tier.store, [False], [0]

    def first_layer_refused(t):
        saves[0] += 1
        tier.store = (lambda src, *a: None) if refusing[0] and saves[0] <= 2 else store
        try:
            return save(t)
        finally:
            tier.store = store

    offloader.save_for_recompute = first_layer_refused
    batch = make_batch(256, 2, 64)
    for step in range(6):
        refusing[0], saves[0] = step % 2 == 1, 0
        run_step(model, batch)
    assert offloader.stats.replayed_passes == 5 and offloader.stats.prefetch_misses == 0, offloader.stats
    handle.remove()
