"""The one prefetch scheduler: its look-ahead rule, its shared byte window, and the three
clients (saved activations, streamed weights, optimizer state) running through one scheduler
with results unchanged."""

import pytest

from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.compose import prepare
from offloadkit.config import ConfigError, OffloadConfig
from offloadkit.testing import (
    assert_bitwise_equal,
    build_llama,
    failed_backward,
    lora_llama,
    make_batch,
    run_step,
)
from offloadkit.testing.cpu_streaming import stream_layers_on_cpu
from offloadkit.transfer import Ahead, PrefetchScheduler, Status


def _walk(items):
    """(name, bytes, group, status) -> the scheduler's upcoming tuples."""
    return ((name, nbytes, group, status) for name, nbytes, group, status in items)


def _lane(scheduler, ahead, name="lane"):
    fetched = []
    return scheduler.lane(name, fetched.append, ahead), fetched


F, H, S = Status.FETCH, Status.HERE, Status.SKIP


def test_groups_count_as_one_step_of_look_ahead_and_items_already_here_count_too():
    scheduler = PrefetchScheduler()
    lane, fetched = _lane(scheduler, Ahead(groups=2))
    items = [("a1", 10, "a", F), ("a2", 10, "a", F), ("b", 10, "b", H), ("c", 10, "c", F)]
    assert scheduler.prefetch(lane, _walk(items)) == 2
    assert fetched == ["a1", "a2"]  # group a is one step, b (already here) the second
    assert lane.pending_bytes == 20 and scheduler.pending_bytes == 20


def test_min_bytes_extends_and_max_bytes_stops_the_walk():
    scheduler = PrefetchScheduler()
    lane, fetched = _lane(scheduler, Ahead(groups=1, min_bytes=250))
    scheduler.prefetch(lane, _walk([(i, 100, None, F) for i in range(6)]))
    assert fetched == [0, 1, 2]  # one group, then on until 250 bytes are ahead
    capped, got = _lane(scheduler, Ahead(min_bytes=10_000, max_bytes=150), "capped")
    scheduler.prefetch(capped, _walk([(i, 100, None, F) for i in range(6)]))
    assert got == [0, 1]  # stops once 150 bytes are ahead: at most the cap plus one item


def test_skipped_items_are_not_counted_and_a_disabled_lane_fetches_nothing():
    scheduler = PrefetchScheduler()
    lane, fetched = _lane(scheduler, Ahead(groups=1))
    scheduler.prefetch(lane, _walk([("busy", 10, None, S), ("next", 10, None, F), ("later", 10, None, F)]))
    assert fetched == ["next"]
    off, none = _lane(scheduler, Ahead())
    assert scheduler.prefetch(off, _walk([("x", 10, None, F)])) == 0 and none == []
    lane.reset()
    assert scheduler.pending_bytes == 0


def test_the_shared_window_bounds_every_lane_together():
    scheduler = PrefetchScheduler(window_bytes=250)
    acts, acts_fetched = _lane(scheduler, Ahead(groups=5), "activations")
    weights, weights_fetched = _lane(scheduler, Ahead(groups=5), "weights")
    scheduler.prefetch(acts, _walk([(f"a{i}", 100, i, F) for i in range(5)]))
    assert acts_fetched == ["a0", "a1"] and acts.held_back == 1
    scheduler.prefetch(weights, _walk([(f"w{i}", 100, i, F) for i in range(5)]))
    assert weights_fetched == [] and weights.held_back == 1  # the window is full
    acts.settle(100)  # a0 was used
    scheduler.prefetch(weights, _walk([(f"w{i}", 100, i, F) for i in range(5)]))
    assert weights_fetched == ["w0"] and scheduler.pending_bytes == 200
    assert scheduler.peak_pending_bytes == 200
    acts.reset()
    weights.settle(1_000)  # more than it has ahead: clamped, never negative
    assert scheduler.pending_bytes == 0 and acts.pending_bytes == weights.pending_bytes == 0
    stats = scheduler.stats()
    assert stats["activations"]["fetched"] == 2 and stats["weights"]["held_back"] == 2


def test_an_item_larger_than_the_window_still_goes_when_nothing_else_is_ahead():
    scheduler = PrefetchScheduler(window_bytes=50)
    lane, fetched = _lane(scheduler, Ahead(groups=2))
    scheduler.prefetch(lane, _walk([("big", 100, None, F), ("next", 10, None, F)]))
    assert fetched == ["big"]  # a window smaller than one item must not stall the run


def test_invalid_arguments_name_the_fix():
    with pytest.raises(ValueError, match="window_bytes"):
        PrefetchScheduler(window_bytes=-1)
    with pytest.raises(ValueError, match=">= 0"):
        Ahead(groups=-1)
    with pytest.raises(ValueError, match="scheduler"):
        from offloadkit import OffloadActivations

        OffloadActivations(scheduler=object())


def _lora_llama():
    pytest.importorskip("peft")
    return lora_llama()


@pytest.mark.parametrize("window", [None, 4 << 20])  # unbounded; one layer's weights (2.9 MB) and some inputs
def test_activations_and_weights_share_one_scheduler_bitwise(window):
    model = _lora_llama()
    batch = make_batch(2048, 2, 32)
    ref = run_step(model, batch)
    scheduler = PrefetchScheduler(window_bytes=window)
    # A stash of one: the block inputs come back from host memory, not from the forward's stash.
    ckpt = apply_activation_checkpointing(
        model, offload_inputs=True, offload_cpu_tensors=True, prefetch=2, max_fwd_stash_size=1, scheduler=scheduler
    )
    streamer = stream_layers_on_cpu(model, depth=2, scheduler=scheduler)
    for _ in range(2):
        got = run_step(model, batch)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "grads")
        # Everything fetched ahead was used or dropped by the end of backward.
        assert scheduler.pending_bytes == 0
    stats = scheduler.stats()
    assert stats["activations"]["fetched"] > 0 and stats["weights"]["fetched"] > 0
    layers = model.config.num_hidden_layers
    if window is None:
        # Unbounded: the streamer's own depth decides, as before: every load (one per layer and
        # direction) was fetched ahead, none waited on demand.
        assert streamer.stats.prefetched == streamer.stats.loads == 2 * 2 * layers and streamer.stats.misses == 0
    else:
        assert scheduler.peak_pending_bytes <= window
        assert stats["activations"]["held_back"] + stats["weights"]["held_back"] > 0  # the window acted
    streamer.remove()
    ckpt.remove()


def test_prepare_gives_every_client_the_runs_scheduler(tmp_path):
    model = build_llama("tiny")
    model.train()
    batch = make_batch(256, 2, 32)
    ref = run_step(model, batch)
    config = OffloadConfig.from_dict(
        {
            "gradient_checkpointing": True,
            "activation_offloading": "disk",
            "disk_dir": str(tmp_path),
            "prefetch_window_bytes": "64KiB",
        }
    )
    runtime = prepare(model, config)
    try:
        assert runtime.scheduler.window_bytes == 64 << 10
        assert runtime.manager.scheduler is runtime.scheduler
        got = run_step(model, batch, runtime.context())
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "grads")
        assert runtime.scheduler.pending_bytes == 0
        assert runtime.scheduler.stats()["activations"]["fetched"] > 0
    finally:
        runtime.close()


def test_the_window_key_is_validated_and_warns_when_nothing_fetches():
    with pytest.raises(ConfigError, match="prefetch_window_bytes"):
        OffloadConfig.from_dict({"prefetch_window_bytes": "-1GiB"})
    with pytest.raises(ConfigError, match="prefetch_window_bytes"):
        OffloadConfig(activation_offloading=True, prefetch_window_bytes=0).validate()
    config = OffloadConfig.from_dict({"prefetch_window_bytes": "1GiB"})
    assert any("prefetch_window_bytes" in w for w in config._warnings)


def test_a_failed_backward_holds_its_bytes_until_its_graph_goes_and_later_steps_settle_exactly():
    """No end-of-pass reset hides a missed settle: after every good step nothing is ahead. A
    backward that fails leaves its fetched-ahead inputs resident while its graph lives; they
    stay counted (their memory is held) and leave the window once the graph is released."""
    model = _lora_llama()
    batch = make_batch(2048, 2, 32)
    scheduler = PrefetchScheduler()
    ckpt = apply_activation_checkpointing(
        model, offload_inputs=True, offload_cpu_tensors=True, prefetch=2, max_fwd_stash_size=1, scheduler=scheduler
    )
    streamer = stream_layers_on_cpu(model, depth=2, scheduler=scheduler)
    run_step(model, batch)
    assert scheduler.pending_bytes == 0

    out = failed_backward(model, model.base_model.model.model.layers[1], batch)
    held = scheduler.stats()["activations"]["pending_bytes"]
    assert held > 0  # inputs of blocks 0-1 fetched ahead, never used: still resident
    for _ in range(2):
        run_step(model, batch)
        assert scheduler.stats()["activations"]["pending_bytes"] == held  # the failed graph still holds them
        assert scheduler.stats()["weights"]["pending_bytes"] == 0
    del out
    ckpt.offloader.drain()
    assert scheduler.pending_bytes == 0
    streamer.remove()
    ckpt.remove()


def test_inside_a_block_only_the_blocks_fetched_for_later_are_ahead():
    """The block in use left the window when its consumer took it: inside block i's forward
    the weights lane holds exactly block i+1 ahead (depth 2), and in backward block i-1."""
    model = _lora_llama()
    batch = make_batch(2048, 2, 32)
    scheduler = PrefetchScheduler()
    streamer = stream_layers_on_cpu(model, depth=2, scheduler=scheduler)
    blocks = model.get_base_model().model.layers
    seen = []
    for i, block in enumerate(blocks):
        block.mlp.register_forward_pre_hook(
            lambda m, a, i=i: seen.append((i, scheduler.stats()["weights"]["pending_bytes"]))
        )
    run_step(model, batch)
    sizes = [layer.nbytes for layer in streamer.layers]
    assert seen == [(i, sizes[i + 1] if i + 1 < len(sizes) else 0) for i in range(len(sizes))]
    assert scheduler.pending_bytes == 0
    streamer.remove()
