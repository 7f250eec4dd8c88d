"""CUDA tests of the disk and tiered storage: bf16 parity, races, 100 steps without leaks."""

import gc
import os

import pytest
import torch

from offloadkit import get_act_offloading_ctx_manager
from offloadkit.checkpointing import apply_activation_checkpointing
from offloadkit.storage import DiskOptions, HostMemoryBudget
from offloadkit.testing import (
    assert_bitwise_equal,
    build_llama,
    make_batch,
    memory_after_each_step,
    run_step,
    step_on_side_stream,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"


def small():
    model = build_llama("small", dtype=torch.bfloat16, device=DEV)
    return model, make_batch(2048, 2, 512, device=DEV)


@pytest.mark.parametrize("storage", ["disk", "tiered"])
def test_bf16_parity_disk(tmp_path, storage):
    model, batch = small()
    ref = run_step(model, batch)
    # An explicit budget: the default also keeps 10% of RAM free, which on machines whose RAM
    # grows as it is used (some VMs) can refuse before the cap is reached.
    budget = HostMemoryBudget((8 << 20) if storage == "tiered" else None, min_free_bytes=1 << 30)
    ctx = get_act_offloading_ctx_manager(
        model, storage=storage, disk=DiskOptions(directory=str(tmp_path)), budget=budget
    )
    for _ in range(2):
        got = run_step(model, batch, ctx)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "grads")
    assert ctx.stats.kept_by_reason["budget"] == 0
    stats = ctx.storage_stats()
    assert stats["disk"]["bytes_written"] > 0 and stats["disk"]["bytes_read"] > 0
    assert ctx.is_idle()
    directory = ctx.tier.directory if storage == "disk" else ctx.tier.disk.directory
    assert os.listdir(directory) == []
    ctx.close()


def test_checkpoint_inputs_to_disk_non_default_stream(tmp_path):
    model, batch = small()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = run_step(model, batch)
    model.gradient_checkpointing_disable()
    handle = apply_activation_checkpointing(
        model, offload_inputs=True, storage="disk", disk=DiskOptions(directory=str(tmp_path))
    )
    got = step_on_side_stream(run_step, model, batch)
    assert_bitwise_equal(ref[0], got[0], "loss")
    assert_bitwise_equal(ref[1], got[1], "grads")
    handle.remove()


def test_hundred_steps_no_leak(tmp_path):
    gc.collect()
    model = build_llama("small", dtype=torch.bfloat16, device=DEV)
    ctx = get_act_offloading_ctx_manager(
        model, storage="tiered", budget=HostMemoryBudget(4 << 20, 1 << 30), disk=DiskOptions(directory=str(tmp_path))
    )

    def check():
        assert ctx.is_idle()

    allocated, rss = memory_after_each_step(model, make_batch(2048, 2, 256, device=DEV), 100, ctx, check)
    assert len(set(allocated[5:])) == 1
    assert rss[-1] - rss[5] < 64 << 20, f"host RSS grew {(rss[-1] - rss[5]) >> 20} MiB"
    assert os.listdir(ctx.tier.disk.directory) == []
    assert ctx.storage_stats()["tiered"]["demoted_entries"] > 0
    ctx.close()


SLOW = 20_000_000  # ~ tens of ms per copy: far longer than a disk read of a few MiB


def _slow_step(model, batch, ctx, stream):
    """A step whose compute runs on ``stream`` behind a long sleep, so that every host->device
    copy from a staging buffer is still queued when the next read wants the buffer."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLOW)
        out = run_step(model, batch, ctx)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("storage", ["disk", "tiered"])
def test_race_disk_read_never_overwrites_a_staging_buffer_in_use(tmp_path, storage, slow):
    model, batch = small()
    ref = run_step(model, batch)
    budget = HostMemoryBudget((4 << 20) if storage == "tiered" else None, min_free_bytes=1 << 30)
    # A tiny in-flight limit and one reader: the same staging memory is recycled read after read.
    ctx = get_act_offloading_ctx_manager(
        model,
        storage=storage,
        budget=budget,
        prefetch=4,
        disk=DiskOptions(directory=str(tmp_path), threads=1, max_inflight_bytes=2 << 20),
    )
    slow(SLOW, kinds=("h2d",))  # every host->device copy sits queued for milliseconds
    for _ in range(2):
        got = _slow_step(model, batch, ctx, torch.cuda.Stream())
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "grads")
    assert ctx.storage_stats()["disk"]["bytes_read"] > 0
    assert ctx.is_idle()
    ctx.close()


def test_race_disk_write_failure_keeps_bytes_in_staging_safely(tmp_path, slow, monkeypatch):
    """Writes fail (disk full): entries stay in their staging blocks, which are read back and
    released with the device copies that use them still queued behind slow host->device
    copies; blocks reused for the next step's staging must not be overwritten under them."""
    import errno

    model, batch = small()
    ref = run_step(model, batch)

    def failing(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", failing)
    ctx = get_act_offloading_ctx_manager(
        model,
        storage="disk",
        prefetch=4,
        budget=HostMemoryBudget(None, min_free_bytes=1 << 30),
        disk=DiskOptions(directory=str(tmp_path), threads=1, max_inflight_bytes=2 << 20),
    )
    slow(SLOW, kinds=("h2d",))
    with pytest.warns(RuntimeWarning, match="No space left"):
        for _ in range(2):
            got = _slow_step(model, batch, ctx, torch.cuda.Stream())
            assert_bitwise_equal(ref[0], got[0], "loss")
            assert_bitwise_equal(ref[1], got[1], "grads")
    assert ctx.storage_stats()["disk"]["fallbacks"] > 0
    assert ctx.is_idle()
    ctx.close()


def test_race_detector_disk_staging_without_the_wait(tmp_path, slow, monkeypatch):
    """Negative control: with the read's wait for its staging buffer removed, the race test
    above must see wrong numbers, or it proves nothing."""
    from offloadkit.storage.pool import HostBlock

    model, batch = small()
    ref = run_step(model, batch)
    ctx = get_act_offloading_ctx_manager(
        model,
        storage="disk",
        prefetch=4,
        budget=HostMemoryBudget(None, min_free_bytes=1 << 30),
        disk=DiskOptions(directory=str(tmp_path), threads=1, max_inflight_bytes=2 << 20),
    )
    run_step(model, batch, ctx)  # warm the staging pool
    monkeypatch.setattr(HostBlock, "wait_host", lambda self: None)
    slow(SLOW, kinds=("h2d",))
    got = _slow_step(model, batch, ctx, torch.cuda.Stream())
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_bitwise_equal(ref[1], got[1], "grads")
    gc.collect()
    ctx.close()


def test_explicit_placement_with_recompute_streaming_and_slow_copies(tmp_path, slow):
    """A plan's placement through prepare() on CUDA: inputs straight to disk, kept in RAM,
    dropped and replayed, kept on the GPU; frozen layers streamed; every copy slowed; on a
    side stream. Bitwise, with exactly the disk places written."""
    import peft

    from offloadkit.compose import prepare
    from offloadkit.testing import randomize_lora_b

    def lora():
        model = build_llama("small", dtype=torch.bfloat16, device=DEV, num_hidden_layers=6)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
        randomize_lora_b(model)
        model.train()
        return model

    ref, ours = lora(), lora()
    ours.load_state_dict(ref.state_dict())
    batch = make_batch(2048, 2, 512, device=DEV)
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    expected = run_step(ref, batch)
    placement = ["disk", "ram", "recompute", "disk", "recompute", "gpu"]
    runtime = prepare(
        ours,
        {
            "gradient_checkpointing": True,
            "activation_offloading": "disk",
            "disk_tiering": True,
            "disk_dir": str(tmp_path),
            "layer_offloading": True,
            "block_input_placement": placement,
        },
    )
    slow(20_000_000)
    for _ in range(2):
        got = step_on_side_stream(run_step, ours, batch, runtime.context())
        assert_bitwise_equal(expected[0], got[0], "loss")
        assert_bitwise_equal(expected[1], got[1], "lora grads")
    report = runtime.report()
    block = 2 * 512 * ours.config.hidden_size * 2
    # Two steps: each disk place written out of its RAM buffer as it was stored, nothing else.
    assert report["storage"]["tiered"]["demoted_entries"] == 2 * placement.count("disk")
    assert report["storage"]["disk"]["bytes_written"] == 2 * placement.count("disk") * block
    assert runtime.streamer.stats.max_resident <= 2
    runtime.close()
