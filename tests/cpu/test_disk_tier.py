"""Disk tier with real files: parity, tiering, cleanup (step end, exception, SIGTERM,
SIGKILL), disk full, O_DIRECT fallback, short I/O."""

import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from offloadkit import OffloadActivations, get_act_offloading_ctx_manager
from offloadkit.storage import DiskFullError, DiskOptions, HostMemoryBudget
from offloadkit.storage.cleanup import create_private_dir, remove_stale_dirs
from offloadkit.testing import (
    assert_bitwise_equal,
    build_llama,
    make_batch,
    randomize_lora_b,
    run_step,
)

from .test_engine_parity import Tricky


def disk_ctx(model, tmp_path, storage="disk", budget=None, **kw):
    return get_act_offloading_ctx_manager(
        model,
        offload_cpu_tensors=True,
        min_offload_size=0,
        storage=storage,
        disk=DiskOptions(directory=str(tmp_path), **kw.pop("disk_kw", {})),
        host_budget_bytes=budget,
        **kw,
    )


def spill_dir(ctx):
    return ctx.tier.directory if ctx.tier.name == "disk" else ctx.tier.disk.directory


@pytest.mark.parametrize("storage", ["disk", "tiered"])
def test_llama_parity_and_files_gone_after_each_step(tmp_path, storage):
    model = build_llama("small")
    batch = make_batch(2048, 2, 64)
    ref = run_step(model, batch)
    ctx = disk_ctx(model, tmp_path, storage, budget=(1 << 20) if storage == "tiered" else None)
    for _ in range(3):
        got = run_step(model, batch, ctx)
        assert_bitwise_equal(ref[0], got[0], "loss")
        assert_bitwise_equal(ref[1], got[1], "grads")
        assert ctx.is_idle()
        assert os.listdir(spill_dir(ctx)) == [], "segment files must be gone at the end of the step"
    disk = ctx.storage_stats()["disk"]
    assert disk["bytes_written"] > 0 and disk["bytes_read"] > 0
    directory = spill_dir(ctx)
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"
    ctx.close()
    assert not os.path.exists(directory)


def test_lora_and_views_parity(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_llama("tiny"), peft.LoraConfig(r=4, target_modules="all-linear"))
    randomize_lora_b(model)
    batch = make_batch(256, 2, 32)
    ref = run_step(model, batch)
    ctx = disk_ctx(model, tmp_path)
    got = run_step(model, batch, ctx)
    assert_bitwise_equal(ref[1], got[1], "lora grads")
    ctx.close()

    torch.manual_seed(1)
    tricky = Tricky()
    x, labels = torch.randn(3, 17, 48), torch.randint(0, 40, (3, 17))
    tricky(x, labels).backward()
    ref = {n: p.grad.clone() for n, p in tricky.named_parameters()}
    tricky.zero_grad(set_to_none=True)
    ctx = OffloadActivations(
        offload_cpu_tensors=True, min_offload_size=0, storage="disk", disk=DiskOptions(directory=str(tmp_path))
    )
    with ctx:
        loss = tricky(x, labels)
    loss.backward()
    assert_bitwise_equal(ref, {n: p.grad.clone() for n, p in tricky.named_parameters()}, "grads")
    ctx.close()


def test_tiering_keeps_the_newest_in_ram(tmp_path):
    x = torch.randn(64, 1024, requires_grad=True)  # 256 KiB per saved tensor
    budget = 6 * (256 << 10)
    ctx = OffloadActivations(
        offload_cpu_tensors=True,
        min_offload_size=0,
        storage="tiered",
        host_budget_bytes=budget,
        disk=DiskOptions(directory=str(tmp_path)),
    )
    with ctx:
        h = x
        for _ in range(16):
            h = h.sin()  # each saves its input: 16 entries of 256 KiB, 4 MiB in all
    tier = ctx.tier
    with tier._lock:  # let background demotions finish
        while tier._demoting:
            tier._lock.wait(timeout=5)
    entries = sorted(ctx._entries, key=lambda e: e.seq)
    in_ram = [e.stored.payload.in_ram for e in entries]
    assert any(in_ram) and not all(in_ram)
    first_ram = in_ram.index(True)
    assert all(in_ram[first_ram:]) and not any(in_ram[:first_ram]), f"newest must be in RAM: {in_ram}"
    assert ctx.budget.peak_bytes <= budget
    h.sum().backward()
    ref = x.grad.clone()
    x.grad = None
    h = x
    for _ in range(16):
        h = h.sin()
    h.sum().backward()
    assert_bitwise_equal(ref, x.grad, "grads")
    assert ctx.storage_stats()["tiered"]["demoted_entries"] > 0
    ctx.close()


def test_files_gone_after_exception(tmp_path):
    model = build_llama("tiny")
    ctx = disk_ctx(model, tmp_path)
    handle = model.model.layers[1].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(KeyError("boom")))
    with pytest.raises(KeyError):
        with ctx:
            model(**make_batch(256, 2, 32))
    handle.remove()
    gc.collect()
    assert ctx.is_idle()
    assert os.listdir(spill_dir(ctx)) == []
    ctx.close()


CHILD = textwrap.dedent("""
    import signal, sys, time, torch
    from offloadkit import OffloadActivations
    from offloadkit.storage import DiskOptions
    stop = []
    if sys.argv[2] == "graceful":  # like Trainer/torchrun/SLURM preemption handlers: finish the step
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    ctx = OffloadActivations(offload_cpu_tensors=True, min_offload_size=0, storage="disk",
                             disk=DiskOptions(directory=sys.argv[1]))
    x = torch.randn(256, 256, requires_grad=True)
    with ctx:
        y = x.sin().cos()
    for e in list(ctx._entries):
        e.stored.payload.write.result()
    print(ctx.tier.directory, ctx.tier.disk_bytes(), flush=True)
    deadline = time.time() + 60
    while not stop and time.time() < deadline:
        time.sleep(0.05)
    y.sum().backward()  # reads the spilled activations back after the signal
    ok = torch.equal(x.grad, (-torch.sin(torch.sin(x.detach())) * torch.cos(x.detach())))
    print("backward-ok" if ok else "backward-wrong", flush=True)
""")


def _spawn(tmp_path, mode="default"):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), mode], stdout=subprocess.PIPE, text=True)
    directory, disk_bytes = proc.stdout.readline().split()
    assert os.path.isdir(directory) and int(disk_bytes) > 0, "child did not spill"
    return proc, directory


def test_sigterm_with_a_graceful_handler_keeps_the_run_going(tmp_path):
    proc, directory = _spawn(tmp_path, "graceful")
    proc.send_signal(signal.SIGTERM)
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == 0
    assert "backward-ok" in out, out
    assert not os.path.exists(directory), "removed at exit"


def test_sigterm_default_action_leaves_no_data_and_the_next_start_cleans_up(tmp_path):
    proc, directory = _spawn(tmp_path)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # offloadkit installs no handler
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert os.listdir(directory) == [], "segment files are unlinked once open: no data outlives the process"
    fresh = create_private_dir(str(tmp_path))
    assert not os.path.exists(directory) and os.path.isdir(fresh)


def test_stale_directory_of_a_killed_process_is_removed(tmp_path):
    proc, directory = _spawn(tmp_path)
    proc.kill()  # SIGKILL: no chance to clean up
    proc.wait(timeout=30)
    assert os.path.isdir(directory)
    fresh = create_private_dir(str(tmp_path))  # a later start cleans up
    assert not os.path.exists(directory) and os.path.isdir(fresh)
    live = create_private_dir(str(tmp_path))  # directories of live processes are kept
    assert remove_stale_dirs(str(tmp_path)) == [] and os.path.isdir(live)


def _tiny_fs(tmp_path):
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    if os.geteuid() == 0:
        rc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)], capture_output=True
        ).returncode
        if rc == 0:
            return mount_point, True
    return mount_point, False


def test_disk_full_falls_back_to_ram_or_raises_a_clear_error(tmp_path, monkeypatch):
    mount_point, mounted = _tiny_fs(tmp_path)
    try:
        if not mounted:  # no tiny filesystem here: report the disk as (nearly) full instead
            import shutil

            real = shutil.disk_usage
            monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=64 << 10))
        x = torch.randn(128, 1024, requires_grad=True)  # 512 KiB per saved tensor: cannot fit

        def run(ctx):
            x.grad = None
            with ctx:
                y = x.sin().cos().tanh()
            y.sum().backward()
            return x.grad.clone()

        x.grad = None
        x.sin().cos().tanh().sum().backward()
        ref = x.grad.clone()
        ctx = OffloadActivations(
            offload_cpu_tensors=True, min_offload_size=0, storage="disk", disk=DiskOptions(directory=str(mount_point))
        )
        with pytest.warns(RuntimeWarning, match="keeping it in host RAM"):
            got = run(ctx)
        assert_bitwise_equal(ref, got, "grads after falling back to RAM")
        assert ctx.storage_stats()["disk"]["fallbacks"] > 0
        ctx.close()

        starved = HostMemoryBudget(limit_bytes=0, min_free_bytes=0)
        ctx = OffloadActivations(
            offload_cpu_tensors=True,
            min_offload_size=0,
            storage="disk",
            budget=starved,
            disk=DiskOptions(directory=str(mount_point)),
        )
        with pytest.raises(DiskFullError, match=r"bytes free and \d+ are needed") as err:
            with ctx:
                x.sin()
        assert str(mount_point) in str(err.value)
        ctx.close()
    finally:
        if mounted:
            subprocess.run(["umount", str(mount_point)], check=False)


def test_write_error_keeps_bytes_in_ram(tmp_path, monkeypatch):
    real = os.pwrite

    def failing(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", failing)
    x = torch.randn(256, 256, requires_grad=True)
    ctx = OffloadActivations(
        offload_cpu_tensors=True, min_offload_size=0, storage="disk", disk=DiskOptions(directory=str(tmp_path))
    )
    with pytest.warns(RuntimeWarning, match="No space left"):
        with ctx:
            y = x.sin().cos()
        y.sum().backward()
    monkeypatch.setattr(os, "pwrite", real)
    got = x.grad.clone()
    x.grad = None
    x.sin().cos().sum().backward()
    assert_bitwise_equal(x.grad, got, "grads")
    ctx.close()


def test_short_writes_are_retried_and_short_reads_raise(tmp_path, monkeypatch):
    real_write, real_read = os.pwrite, os.preadv

    def half_write(fd, data, offset):
        return real_write(fd, data[: max(4096, len(data) // 2)], offset)

    monkeypatch.setattr(os, "pwrite", half_write)
    x = torch.randn(512, 512, requires_grad=True)
    ctx = OffloadActivations(
        offload_cpu_tensors=True,
        min_offload_size=0,
        storage="disk",
        disk=DiskOptions(directory=str(tmp_path), direct_io=False),
    )
    with ctx:
        y = x.sin().cos()
    y.sum().backward()
    got = x.grad.clone()
    x.grad = None
    x.sin().cos().sum().backward()
    assert_bitwise_equal(x.grad, got, "grads after short writes")
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: 0)  # file ends early
    with ctx:
        y = x.sin().cos()
    with pytest.raises(OSError, match="short read"):
        y.sum().backward()
    monkeypatch.setattr(os, "preadv", real_read)
    del y
    gc.collect()
    ctx.close()


def test_o_direct_unsupported_falls_back(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    x = torch.randn(256, 256, requires_grad=True)
    # a filesystem without O_DIRECT (older tmpfs, some overlays) refuses it with EINVAL at open
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    x.grad = None
    ctx = OffloadActivations(
        offload_cpu_tensors=True,
        min_offload_size=0,
        storage="disk",
        disk=DiskOptions(directory=str(tmp_path), direct_io="auto"),
    )
    with ctx:
        y = x.sin().cos()
    y.sum().backward()
    assert ctx.storage_stats()["disk"]["direct_io"] is False
    got = x.grad.clone()
    ctx.close()
    x.grad = None
    x.sin().cos().sum().backward()
    assert_bitwise_equal(x.grad, got, "grads with buffered I/O")
    strict = OffloadActivations(
        offload_cpu_tensors=True,
        min_offload_size=0,
        storage="disk",
        disk=DiskOptions(directory=str(tmp_path), direct_io=True),
    )
    with pytest.raises(OSError, match="O_DIRECT"):
        with strict:
            x.sin()
    strict.close()


def test_bad_options_and_unwritable_directory(tmp_path):
    with pytest.raises(ValueError, match="threads"):
        DiskOptions(threads=0)
    with pytest.raises(ValueError, match="direct_io"):
        DiskOptions(direct_io="sometimes")
    with pytest.raises(ValueError, match="storage"):
        OffloadActivations(storage="tape")
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(OSError, match="spill directory"):
        OffloadActivations(offload_cpu_tensors=True, storage="disk", disk=DiskOptions(directory=str(blocked / "x")))


def test_checkpoint_inputs_to_disk(tmp_path):
    from offloadkit.checkpointing import apply_activation_checkpointing

    model = build_llama("small").train()
    batch = make_batch(2048, 2, 64)
    ref = run_step(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        handle = apply_activation_checkpointing(
            model,
            offload_inputs=True,
            offload_cpu_tensors=True,
            storage="disk",
            disk=DiskOptions(directory=str(tmp_path)),
        )
        got = run_step(model, batch)
    assert_bitwise_equal(ref[1], got[1], "grads")
    assert handle.offloader.storage_stats()["disk"]["bytes_written"] > 0
    handle.remove()


def test_tiered_with_a_tight_budget_offloads_everything(tmp_path):
    model = build_llama("small")
    batch = make_batch(2048, 2, 64)
    ref = run_step(model, batch)
    ctx = disk_ctx(model, tmp_path, "tiered", budget=1 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "budget reached, kept on the device"
        for _ in range(3):
            got = run_step(model, batch, ctx)
            assert_bitwise_equal(ref[1], got[1], "grads")
    assert ctx.stats.kept_by_reason["budget"] == 0
    assert ctx.storage_stats()["tiered"]["demoted_entries"] > 0
    ctx.close()


def test_entries_larger_than_the_ram_budget_still_reach_disk(tmp_path):
    x = torch.randn(1024, 1024, requires_grad=True)  # 4 MiB saved tensors, budget 1 MiB
    ctx = OffloadActivations(
        offload_cpu_tensors=True,
        min_offload_size=0,
        storage="tiered",
        budget=HostMemoryBudget(1 << 20, min_free_bytes=0),
        disk=DiskOptions(directory=str(tmp_path)),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with ctx:
            y = x.sin().cos()
        y.sum().backward()
    assert ctx.stats.kept_by_reason["budget"] == 0
    assert ctx.storage_stats()["disk"]["bytes_written"] >= 2 * (4 << 20)
    got = x.grad.clone()
    x.grad = None
    x.sin().cos().sum().backward()
    assert_bitwise_equal(x.grad, got, "grads")
    ctx.close()


def test_planned_places_override_the_tiered_order(tmp_path):
    """``placed("disk")`` saves are written to disk as they are stored; ``placed("ram")`` saves are never demoted
    (when RAM must be made, unplaced entries go to disk instead); ``placed("gpu")`` saves are
    kept. Bitwise."""
    from offloadkit.runtime.storages import storage_key

    x = torch.randn(256, 1024, requires_grad=True)  # 1 MiB saved tensors
    ctx = OffloadActivations(
        offload_cpu_tensors=True,
        min_offload_size=0,
        storage="tiered",
        budget=HostMemoryBudget(64 << 20, min_free_bytes=0),  # no pressure until asked for below
        disk=DiskOptions(directory=str(tmp_path)),
    )
    with ctx:
        with ctx.placed("ram"):
            a = x.sin()  # saves x
        with ctx.placed("ram"):
            b = a.sin()  # saves a
        with ctx.placed("disk"):
            c = b.sin()  # saves b
        d = c.sin().sin()  # saves c and c.sin(), unplaced
        with ctx.placed("gpu"):
            e = d.sin()  # saves d, kept
        # Ask for all of RAM: every entry that may be demoted is.
        ctx.tier._make_room(64 << 20, wait=False)
        # Every demotion finished, its completion included (it may run on the I/O thread
        # after the write's future is done).
        deadline = time.monotonic() + 30
        while ctx.tier._demoting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not ctx.tier._demoting, "a demotion did not finish"
    tiered = ctx.storage_stats()["tiered"]
    assert tiered["disk_entries"] == 0, "nothing needed the staging path"
    assert tiered["demoted_entries"] == 3, "the disk place as it was stored, the unplaced ones when asked"
    where = {entry.key: entry.stored.payload.in_ram for entry in ctx._entries}
    assert where[storage_key(x.untyped_storage())] and where[storage_key(a.untyped_storage())], "RAM places stay"
    assert not where[storage_key(b.untyped_storage())] and not where[storage_key(c.untyped_storage())]
    assert ctx.stats.kept_by_reason["placed"] == 1
    e.sum().backward()
    got = x.grad.clone()
    x.grad = None
    x.sin().sin().sin().sin().sin().sin().sum().backward()
    assert_bitwise_equal(x.grad, got, "grads")
    with pytest.raises(ValueError, match="is not a place"):
        with ctx.placed("nvme"):
            pass
    ctx.close()
