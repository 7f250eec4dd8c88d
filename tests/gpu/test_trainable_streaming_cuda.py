"""Trainable-layer streaming on the GPU: a full fine-tune whose block weights live in pinned
host memory, updated in backward by BackwardAdamW while each block is resident and written
back on the device->host stream as it leaves. Bitwise the unstreamed run (pure bf16 and fp32
master weights), with every copy delayed by milliseconds, under checkpointing and activation
offloading, with deferred (clipped) updates through the GPU's mapping of the host copies, and
with the blocks' weights off the GPU between steps."""

import pytest
import torch

from offloadkit import OffloadActivations
from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.layers import apply_layer_streaming
from offloadkit.optim import BackwardAdamW
from offloadkit.testing import assert_bitwise_equal, build_llama, make_batch
from offloadkit.testing.delays import slow_copies

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")
DEV = "cuda"
STEPS = 5
SLOW = 2_000_000  # GPU cycles before each copy: about a millisecond


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(model, opt, batches, ctx=None, clip=None):
    losses = []
    for batch in batches:
        if ctx is not None:
            with ctx:
                loss = model(**batch).loss
        else:
            loss = model(**batch).loss
        loss.backward()
        if clip is not None and not isinstance(opt, BackwardAdamW):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    torch.cuda.synchronize()
    return torch.stack(losses)


def _batches(vocab):
    return [make_batch(vocab, 2, 256, device=DEV, seed=s) for s in range(STEPS)]


@pytest.mark.parametrize("precision", ["params", "fp32_master", "params-fused"])
@pytest.mark.parametrize("slow", [False, True], ids=["plain", "slow-copies"])
def test_bitwise_the_unstreamed_run(precision, slow):
    # The fused kernel writes the weights without moving their version counters.
    precision, _, kernel = precision.partition("-")
    fused = {"fused": True} if kernel else {}
    ref = build_llama("small", dtype=torch.bfloat16, device=DEV)
    ours = build_llama("small", dtype=torch.bfloat16, device=DEV)
    batches = _batches(ref.config.vocab_size)
    for model in (ref, ours):
        apply_activation_checkpointing(model)
    expected = _run(ref, BackwardAdamW.for_precision(ref.parameters(), precision, lr=1e-3, **fused), batches)
    streamer = apply_layer_streaming(ours, trainable=True)
    opt = BackwardAdamW.for_precision(ours.parameters(), precision, lr=1e-3, **fused)
    delay = slow_copies(SLOW) if slow else None
    try:
        got = _run(ours, opt, batches)
    finally:
        if delay is not None:
            delay.remove()
    assert_bitwise_equal(expected, got, "losses")
    assert_bitwise_equal(_weights(ref), _weights(ours), "weights")
    stats = streamer.collect_stats()
    layers = ours.config.num_hidden_layers
    assert stats.write_backs == STEPS * layers and stats.misses == 0 and stats.max_resident <= 2
    streamer.remove()


def test_with_activation_offloading_and_clipping_deferred():
    """Clipping defers every update to step(), after the blocks left: the update then reads
    and writes the evicted weights in host memory over the bus, and must still be exact."""
    ref = build_llama("small", dtype=torch.bfloat16, device=DEV)
    ours = build_llama("small", dtype=torch.bfloat16, device=DEV)
    batches = _batches(ref.config.vocab_size)
    expected = _run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), batches, clip=0.5)
    streamer = apply_layer_streaming(ours, trainable=True)
    opt = BackwardAdamW(ours.parameters(), lr=1e-3, max_grad_norm=0.5)
    with slow_copies(SLOW):
        got = _run(ours, opt, batches, ctx=OffloadActivations())
    assert_bitwise_equal(expected, got, "losses")
    assert_bitwise_equal(_weights(ref), _weights(ours), "weights")
    assert streamer.collect_stats().write_backs == 0
    streamer.remove()


def test_block_weights_leave_the_gpu():
    model = build_llama("small", dtype=torch.bfloat16, device=DEV)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    streamer = apply_layer_streaming(model, trainable=True)
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    assert freed >= streamer.streamed_bytes * 0.99, (freed, streamer.streamed_bytes)
    opt = BackwardAdamW(model.parameters(), lr=1e-3)
    batch = make_batch(model.config.vocab_size, 2, 256, device=DEV)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        model(**batch).loss.backward()
        opt.step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    # Between steps the blocks' weights stay off the GPU (no gradient or moment stays either).
    assert after <= before - streamer.streamed_bytes + (8 << 20), (after, before, streamer.streamed_bytes)
    streamer.remove()


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_through_the_trainer_bitwise_and_resumed(tmp_path, max_grad_norm):
    """``layer_offloading`` with ``optimizer_offloading`` on a full fine-tune: the Trainer's
    losses and weights bitwise those of the Trainer's own AdamW without streaming, and a
    checkpoint saved from the streamed weights resumes exactly."""
    transformers = pytest.importorskip("transformers")
    from offloadkit.data import TokenBlocks, byte_tokenizer, load_texts
    from offloadkit.integrations.trainer import ActivationOffloadingMixin

    class OffloadTrainer(ActivationOffloadingMixin, transformers.Trainer):
        pass

    offload = {"optimizer_offloading": True, "layer_offloading": True, "activation_offloading": False}

    def train(cls, out, resume=None, **kw):
        torch.manual_seed(0)
        model = build_llama("tiny", vocab_size=259, attn_implementation="sdpa", dtype=torch.bfloat16, device=DEV)
        args = transformers.TrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=2,
            max_steps=4,
            learning_rate=3e-3,
            warmup_steps=2,
            lr_scheduler_type="linear",
            optim="adamw_torch",
            logging_steps=1,
            report_to=[],
            disable_tqdm=True,
            seed=0,
            remove_unused_columns=False,
            max_grad_norm=max_grad_norm,
            **kw,
        )
        extra = {"offload_config": offload} if cls is OffloadTrainer else {}
        data = TokenBlocks(byte_tokenizer(), load_texts(), 64)
        trainer = cls(model=model, args=args, train_dataset=data, **extra)
        trainer.train(resume_from_checkpoint=resume)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return trainer, losses, _weights(model)

    _, ref_losses, ref_weights = train(transformers.Trainer, tmp_path / "plain", save_strategy="no")
    trainer, losses, weights = train(OffloadTrainer, tmp_path / "ours", save_strategy="steps", save_steps=2)
    streamed = trainer.offload_report["layer_streaming"]
    assert streamed["trainable"] and streamed["layers"] == 2 and streamed["misses"] == 0
    # Updates in backward write each layer back once a step; deferred ones change the host copies in place.
    assert streamed["write_backs"] == (2 * 4 if max_grad_norm == 0.0 else 0)
    if max_grad_norm:
        assert any("over the bus" in n for n in trainer.offload_report["notes"])
    assert losses == ref_losses and len(losses) == 4
    assert_bitwise_equal(ref_weights, weights, "weights after training")
    _, resumed_losses, resumed_weights = train(
        OffloadTrainer, tmp_path / "ours", resume=str(tmp_path / "ours" / "checkpoint-2"), save_strategy="no"
    )
    assert resumed_losses[-2:] == ref_losses[2:]
    assert_bitwise_equal(ref_weights, resumed_weights, "weights after resuming")


def test_state_in_memory_mapped_files(tmp_path):
    """``state_dir``: the moments rest in mapped files (pageable memory, copies that wait for
    the host) and the run stays bitwise the pinned one, with the weights streamed too."""
    ref = build_llama("small", dtype=torch.bfloat16, device=DEV)
    ours = build_llama("small", dtype=torch.bfloat16, device=DEV)
    batches = _batches(ref.config.vocab_size)
    expected = _run(ref, BackwardAdamW(ref.parameters(), lr=1e-3), batches)
    streamer = apply_layer_streaming(ours, trainable=True)
    opt = BackwardAdamW(ours.parameters(), lr=1e-3, state_dir=str(tmp_path))
    with slow_copies(SLOW):
        got = _run(ours, opt, batches)
    assert_bitwise_equal(expected, got, "losses")
    assert_bitwise_equal(_weights(ref), _weights(ours), "weights")
    state = opt.state[ours.lm_head.weight]
    assert not state["exp_avg"].is_pinned() and state["exp_avg"].untyped_storage().filename is not None
    streamer.remove()


def _use_a_layer_weight_before_its_block(model):
    """A streamed weight also used before its block: its gradient completes after the block
    has left, and its update then writes the host copy while the block's write-back may still
    be in flight."""
    weight = model.model.layers[1].mlp.down_proj.weight

    def hook(module, args, output):
        return output + 1e-3 * weight.float().mean().to(output.dtype)

    return model.model.embed_tokens.register_forward_hook(hook)


@pytest.mark.parametrize("fused", [False, True], ids=["default", "fused"])
def test_an_update_after_the_block_left_waits_for_its_write_back(fused):
    ref = build_llama("small", dtype=torch.bfloat16, device=DEV)
    ours = build_llama("small", dtype=torch.bfloat16, device=DEV)
    for model in (ref, ours):
        _use_a_layer_weight_before_its_block(model)
    batches = _batches(ref.config.vocab_size)
    expected = _run(ref, BackwardAdamW(ref.parameters(), lr=1e-3, fused=fused), batches)
    streamer = apply_layer_streaming(ours, trainable=True)
    opt = BackwardAdamW(ours.parameters(), lr=1e-3, fused=fused)
    with slow_copies(20 * SLOW, kinds=("d2h",)):  # write-backs land long after the late update
        got = _run(ours, opt, batches)
    assert_bitwise_equal(expected, got, "losses")
    assert_bitwise_equal(_weights(ref), _weights(ours), "weights")
    streamer.remove()


def test_reading_the_weights_after_a_failed_backward_waits_for_write_backs():
    """A backward that raises never reaches its end: the write-backs it queued are still
    ordered before ``state_dict()`` reads the host copies."""
    ours = build_llama("small", dtype=torch.bfloat16, device=DEV)
    streamer = apply_layer_streaming(ours, trainable=True)
    opt = BackwardAdamW(ours.parameters(), lr=1e-3)
    batch = make_batch(ours.config.vocab_size, 2, 256, device=DEV)
    calls = {"n": 0}

    def fail_late(grad):
        calls["n"] += 1
        raise RuntimeError("injected")

    handle = ours.model.embed_tokens.weight.register_hook(fail_late)
    with slow_copies(20 * SLOW, kinds=("d2h",)):
        with pytest.raises(RuntimeError, match="injected"):
            ours(**batch).loss.backward()
        saved = {k: v.clone() for k, v in ours.state_dict().items()}
    handle.remove()
    torch.cuda.synchronize()
    assert calls["n"] == 1 and streamer.collect_stats().write_backs > 0
    assert_bitwise_equal(saved, {k: v.clone() for k, v in ours.state_dict().items()}, "weights read before and after")
    streamer.remove()
    del opt


@pytest.mark.parametrize("precision", ["params", "fp32_master"])
def test_blocks_in_files_bitwise_and_a_deferred_update_refused(tmp_path, precision):
    """Every block past a tiny host budget rests in a file: updated in backward while
    resident, written back through pinned staging and an I/O thread, read back for the next
    step; bitwise the unstreamed run with every copy delayed. An update deferred to step()
    (clipping) cannot reach a weight in a file and says so."""
    from offloadkit.storage import HostMemoryBudget

    ref = build_llama("small", dtype=torch.bfloat16, device=DEV)
    ours = build_llama("small", dtype=torch.bfloat16, device=DEV)
    batches = _batches(ref.config.vocab_size)
    for model in (ref, ours):
        apply_activation_checkpointing(model)
    expected = _run(ref, BackwardAdamW.for_precision(ref.parameters(), precision, lr=1e-3), batches)
    budget = HostMemoryBudget(limit_bytes=4096, min_free_bytes=0)
    streamer = apply_layer_streaming(ours, trainable=True, budget=budget, disk_dir=str(tmp_path))
    assert streamer.stats.disk_layers == len(streamer.layers)
    opt = BackwardAdamW.for_precision(ours.parameters(), precision, lr=1e-3)
    with slow_copies(SLOW):
        got = _run(ours, opt, batches)
    assert_bitwise_equal(expected, got, "losses")
    on_cpu = {n: p.detach().cpu() for n, p in ours.named_parameters()}  # evicted blocks rest in files
    assert_bitwise_equal({n: p.detach().cpu() for n, p in ref.named_parameters()}, on_cpu, "weights")
    stats = streamer.collect_stats()
    assert stats.write_backs == STEPS * len(streamer.layers) and stats.misses == 0
    assert stats.disk_read_bytes == 2 * STEPS * stats.disk_bytes
    clipped = BackwardAdamW(ours.parameters(), lr=1e-3, max_grad_norm=1.0)
    opt.remove()
    ours(**batches[0]).loss.backward()
    with pytest.raises(RuntimeError, match="rests in a file"):
        clipped.step()
    streamer.remove()
