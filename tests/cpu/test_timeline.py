"""The one set of step hooks (``transfer.StepTimeline``): activation offloading, checkpoint-input
offload and layer streaming act on one timeline's points, one end-of-backward callback per
backward serves them all, and removing the clients leaves the model without hooks."""

import pytest
import torch

from offloadkit import OffloadActivations, get_act_offloading_ctx_manager
from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.compose import prepare
from offloadkit.models.heads import find_output_head
from offloadkit.testing import (
    assert_bitwise_equal,
    build_llama,
    failed_backward,
    lora_llama,
    make_batch,
    run_step,
)
from offloadkit.testing.cpu_streaming import stream_layers_on_cpu
from offloadkit.transfer import StepTimeline, TimelineListener

pytest.importorskip("peft")


class Spy(TimelineListener):
    """Records the points it sees; arms a backward call at the head and every block."""

    def __init__(self, log, name="spy"):
        self.log, self.name = log, name

    def forward_start(self, module, args):
        self.log.append((self.name, "forward_start"))

    def forward_end(self, module, output):
        self.log.append((self.name, "forward_end", output is None))

    def head_start(self):
        self.log.append((self.name, "head_start"))

    def head_end(self, output):
        return lambda: self.log.append((self.name, "backward_at_head"))

    def block_end(self, block, output):
        return lambda: self.log.append((self.name, "backward_at_block"))

    def backward_end(self, task):
        self.log.append((self.name, "backward_end"))


def _hooks_on(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_engine_and_streamer_share_one_timeline_bitwise():
    model = lora_llama()
    batch = make_batch(2048, 2, 32)
    ref = run_step(model, batch)
    hooks_before = _hooks_on(model)
    timeline = StepTimeline(model, head=find_output_head(model))
    manager = get_act_offloading_ctx_manager(model, offload_cpu_tensors=True, timeline=timeline)
    streamer = stream_layers_on_cpu(model, depth=2, timeline=timeline)
    log = []
    timeline.subscribe(Spy(log))
    # Hooked once: the model (2), the head (2) and each block (2), whatever the clients.
    layers = model.config.num_hidden_layers
    assert _hooks_on(model) - hooks_before == 2 + 2 + 2 * layers
    for _ in range(2):
        log.clear()
        got = run_step(model, batch, manager)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "grads")
        # The engine's passes ended with the backward: nothing held, nothing fetched ahead.
        assert manager.is_idle() and manager.scheduler.pending_bytes == 0
        assert streamer.resident_layers == 0
        assert [e[1] for e in log].count("backward_end") == 1
        assert [e[1] for e in log].count("backward_at_block") == layers
        assert log[-1] == ("spy", "backward_end")
    assert streamer.stats.misses == 0 and streamer.stats.prefetched == streamer.stats.loads == 2 * 2 * layers
    assert manager.stats.offloaded_tensors > 0
    streamer.remove()
    manager.remove()
    timeline.remove()
    assert _hooks_on(model) == hooks_before


def test_backward_calls_bind_forward_state_and_listeners_run_in_subscription_order():
    model = build_llama("tiny")
    model.train()
    timeline = StepTimeline(model, head=model.lm_head)
    log = []
    timeline.subscribe(Spy(log, "a"))
    second = timeline.subscribe(Spy(log, "b"))
    # Two forwards (gradient accumulation into one backward): each head arms its own calls.
    losses = [model(**make_batch(256, 1, 16, seed=s)).loss for s in (0, 1)]
    assert log[:2] == [("a", "forward_start"), ("b", "forward_start")]
    assert log.count(("a", "forward_end", False)) == 2
    log.clear()
    (losses[0] + losses[1]).backward()
    assert log.count(("a", "backward_at_head")) == log.count(("b", "backward_at_head")) == 2
    assert log.index(("a", "backward_at_head")) < log.index(("b", "backward_at_head"))
    assert log[-2:] == [("a", "backward_end"), ("b", "backward_end")]  # one end for the backward
    second.remove()
    log.clear()
    run_step(model, make_batch(256, 1, 16))
    assert all(e[0] == "a" for e in log) and ("a", "backward_end") in log
    timeline.remove()
    log.clear()
    run_step(model, make_batch(256, 1, 16))
    assert log == []  # no hooks left


def test_a_forward_that_raises_still_reports_its_end():
    model = build_llama("tiny")
    timeline = StepTimeline(model, head=model.lm_head)
    log = []
    timeline.subscribe(Spy(log))
    handle = model.model.layers[0].register_forward_hook(lambda *_: (_ for _ in ()).throw(KeyError("boom")))
    with pytest.raises(KeyError):
        model(**make_batch(256, 1, 16))
    handle.remove()
    assert log[-1] == ("spy", "forward_end", True)
    timeline.remove()


def test_a_failed_backward_does_not_keep_the_next_one_from_ending():
    model = lora_llama()
    batch = make_batch(2048, 2, 32)
    ref = run_step(model, batch)
    checkpointing = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True, prefetch=2)
    streamer = stream_layers_on_cpu(model, depth=2, timeline=checkpointing.offloader.timeline)
    log = []
    streamer.timeline.subscribe(Spy(log))
    out = failed_backward(model, model.base_model.model.model.layers[1], batch)
    assert ("spy", "backward_end") not in log  # the failed pass never ends
    del out
    log.clear()
    got = run_step(model, batch)
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert log.count(("spy", "backward_end")) == 1
    assert streamer.resident_layers == 0 and checkpointing.offloader.is_idle()
    streamer.remove()
    checkpointing.remove()


def test_prepare_makes_one_timeline_and_close_leaves_no_hooks(tmp_path):
    model = build_llama("tiny")
    model.train()
    batch = make_batch(256, 2, 32)
    ref = run_step(model, batch)
    hooks_before = _hooks_on(model)
    runtime = prepare(
        model, {"gradient_checkpointing": True, "activation_offloading": "disk", "disk_dir": str(tmp_path)}
    )
    assert runtime.manager.timeline is runtime.timeline and runtime.timeline.head is model.lm_head
    got = run_step(model, batch, runtime.context())
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    runtime.attach_to_forward()  # the callback route subscribes to the same timeline
    got = run_step(model, batch)
    assert_bitwise_equal(ref[1], got[1], "grads (attached to forward)")
    runtime.close()
    assert _hooks_on(model) == hooks_before


def test_a_client_with_another_head_is_refused():
    model = build_llama("tiny")
    timeline = StepTimeline(model, head=model.lm_head)
    with pytest.raises(ValueError, match="head=Embedding is not the shared timeline's head"):
        get_act_offloading_ctx_manager(model, head=model.model.embed_tokens, timeline=timeline)
    with pytest.raises(ValueError, match="subclass transfer.TimelineListener"):
        timeline.subscribe(object())
    timeline.remove()


def test_a_bare_engine_ends_its_passes_without_any_module_hook():
    layer = torch.nn.Linear(64, 64)
    manager = OffloadActivations(offload_cpu_tensors=True, min_offload_size=0)
    assert manager.timeline.model is None
    x = torch.randn(8, 64, requires_grad=True)
    with manager:
        loss = layer(torch.relu(layer(x))).sum()
    loss.backward()
    assert manager.is_idle() and manager.scheduler.pending_bytes == 0
    assert manager.stats.offloaded_tensors > 0
    manager.close()


def test_removing_one_client_keeps_the_other_on_the_shared_blocks():
    model = lora_llama()
    batch = make_batch(2048, 2, 32)
    ref = run_step(model, batch)
    layers = model.config.num_hidden_layers
    checkpointing = apply_activation_checkpointing(model, offload_inputs=True, offload_cpu_tensors=True, prefetch=2)
    streamer = stream_layers_on_cpu(model, depth=2, timeline=checkpointing.offloader.timeline)
    checkpointing.remove()  # it watched the blocks first
    loads = streamer.stats.loads
    got = run_step(model, batch)
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert streamer.stats.loads - loads == 2 * layers and streamer.stats.misses == 0
    streamer.remove()

    streamer = stream_layers_on_cpu(model, depth=2)
    checkpointing = apply_activation_checkpointing(
        model, offload_inputs=True, offload_cpu_tensors=True, prefetch=2, max_fwd_stash_size=1
    )
    # The other order: checkpointing joins the streamer's timeline, then the streamer leaves.
    checkpointing.remove()
    checkpointing = apply_activation_checkpointing(
        model, offload_inputs=OffloadActivations_on(streamer.timeline), prefetch=2, max_fwd_stash_size=1
    )
    streamer.remove()
    got = run_step(model, batch)
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert checkpointing.offloader.stats.prefetch_hits > 0  # block outputs still start the fetches
    checkpointing.remove()


def OffloadActivations_on(timeline):  # noqa: N802 - reads as the constructor it wraps
    return OffloadActivations(offload_cpu_tensors=True, max_fwd_stash_size=1, timeline=timeline)


def test_a_closed_run_does_not_keep_the_model_alive(tmp_path):
    import gc
    import weakref

    model = build_llama("tiny")
    model.train()
    runtime = prepare(
        model, {"gradient_checkpointing": True, "activation_offloading": "disk", "disk_dir": str(tmp_path)}
    )
    run_step(model, make_batch(256, 2, 32), runtime.context())
    manager = runtime.manager
    runtime.close()
    alive = weakref.ref(model)
    gc.collect()
    gc.disable()  # freed by reference counting, as without offloadkit: no cycle through the timeline
    try:
        del model, runtime
        assert alive() is None
    finally:
        gc.enable()
    assert manager.timeline.model is None


def test_attaching_to_forward_after_the_managers_hooks_went_still_offloads():
    from offloadkit.api import attach_to_forward

    model = build_llama("tiny")
    model.train()
    manager = get_act_offloading_ctx_manager(model, offload_cpu_tensors=True)
    manager.remove()
    handle = attach_to_forward(manager, model)
    run_step(model, make_batch(256, 2, 32))
    assert manager.stats.offloaded_tensors > 0
    handle.remove()
    manager.close()
