"""Host buffer pool, size classes, host-memory budget, RAM tier (CPU paths)."""

import pytest
import torch

from offloadkit.storage import HostBufferPool, HostMemoryBudget, HostTier, size_class

GiB = 1 << 30


def budget(limit=None, available=64 * GiB, min_free=0):
    return HostMemoryBudget(limit_bytes=limit, min_free_bytes=min_free, available_fn=lambda: available)


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 10_000, 1 << 20, (1 << 20) + 1, 123_456_789])
def test_size_class_is_whole_pages(n):
    c = size_class(n)
    assert c >= n and c % 4096 == 0 and c - n < 4096 or (n < 4096 and c == 4096)


def test_pool_reuses_memory_and_accounts_bytes():
    b = budget()
    pool = HostBufferPool(pin_memory=False, budget=b)
    blk = pool.acquire(10_000)
    assert blk.capacity == size_class(10_000) and not blk.pinned
    assert pool.bytes_in_use == blk.capacity and b.used_bytes == pool.bytes_held == 8 << 20  # one chunk
    assert blk.buffer.data_ptr() % 4096 == 0
    pool.release(blk)
    assert pool.bytes_in_use == 0 and pool.bytes_idle == pool.bytes_held
    again = pool.acquire(9_999)
    assert again.buffer.data_ptr() == blk.buffer.data_ptr() and pool.allocations == 1 and pool.reuses == 1
    pool.release(again)
    assert pool.trim() == 8 << 20
    assert b.used_bytes == 0 and pool.bytes_held == 0


def test_pool_without_growth_holds_exactly_its_blocks(monkeypatch):
    """Streamed weights: one block per layer, sized once. Every byte held must be a layer's:
    growth chunks would leave tails shorter than a layer that nothing can use."""
    import offloadkit.storage.pool as pool_module

    monkeypatch.setattr(pool_module, "_MIN_CHUNK", 64 << 10)
    monkeypatch.setattr(pool_module, "_MAX_CHUNK", 512 << 10)
    layer = 416 << 10
    b = budget()
    pool = HostBufferPool(pin_memory=False, budget=b, grow_in_chunks=False)
    blocks = [pool.acquire(layer) for _ in range(32)]
    assert pool.bytes_held == b.used_bytes == 32 * layer
    for blk in blocks:
        pool.release(blk)
    grown = HostBufferPool(pin_memory=False, budget=budget())
    blocks = [grown.acquire(layer) for _ in range(32)]
    assert grown.bytes_held > 32 * layer, "growth chunks do leave such tails (why the streamer opts out)"


def test_growing_pool_serves_larger_blocks_of_later_steps_from_its_slack():
    """Variable lengths: one save per step, its size growing from 5 to 8 MiB. The first
    chunk has room to spare, and every later block fits in it: nothing more is registered."""
    pool = HostBufferPool(pin_memory=False, budget=budget())
    for size in range(5 << 20, (8 << 20) + 1, 256 << 10):
        pool.release(pool.acquire(size))
    assert pool.allocations == 1 and pool.bytes_held == 8 << 20


def test_pool_blocks_coalesce_when_released():
    pool = HostBufferPool(pin_memory=False, budget=budget())
    a, m, c = (pool.acquire(1 << 20) for _ in range(3))
    assert m.buffer.data_ptr() == a.buffer.data_ptr() + (1 << 20)
    for blk in (a, c, m):  # the middle one last: all three merge with the rest of the chunk
        pool.release(blk)
    whole = pool.acquire(8 << 20)
    assert whole.buffer.data_ptr() == a.buffer.data_ptr() and pool.allocations == 1


class FakeEvent:
    """A device copy still in flight until ``done`` (CPU stand-in for a CUDA event)."""

    def __init__(self):
        self.done = False
        self.synchronized = 0

    def query(self):
        return self.done

    def synchronize(self):
        self.synchronized += 1
        self.done = True


def test_pending_copies_follow_reused_and_merged_memory():
    pool = HostBufferPool(pin_memory=False, budget=budget())
    a, b_ = pool.acquire(1 << 20), pool.acquire(1 << 20)
    ev_a, ev_b = FakeEvent(), FakeEvent()
    pool.release(a, ("stream-1", ev_a))
    pool.release(b_, ("stream-2", ev_b))  # merges with a's range: both copies still pending
    big = pool.acquire(2 << 20)
    assert {id(e) for _, e in big.uses} == {id(ev_a), id(ev_b)}
    big.wait_host()  # a host write (disk read) must wait for both
    assert ev_a.synchronized == 1 and ev_b.synchronized == 1 and big.uses == []
    done = FakeEvent()
    done.done = True
    pool.release(big, ("stream-1", done))
    assert pool.acquire(4096).uses == [], "completed copies are dropped"


def test_variable_lengths_hold_about_the_largest_step():
    """SFT without packing: every step saves tensors of new sizes. Memory held follows the
    largest step (within 1.25x) and nothing new is allocated once it has been seen."""
    import random

    rng = random.Random(0)
    pool = HostBufferPool(pin_memory=False, budget=budget())
    # bytes per token of one decoder layer's saved tensors (hidden 2048, MLP 8192, bf16)
    per_token = [4096, 4096, 4096, 1024, 1024, 4096, 16384, 16384, 16384, 4096]
    lengths = [rng.randint(1024, 16384) for _ in range(50)]
    longest_at = lengths.index(max(lengths))
    allocations_after_longest = None
    for step, n in enumerate(lengths):
        blocks = [pool.acquire(n * w) for _ in range(16) for w in per_token]  # 16 layers
        for blk in reversed(blocks):  # backward frees in reverse
            pool.release(blk)
        if step == longest_at:
            allocations_after_longest = pool.allocations
    need = max(lengths) * sum(per_token) * 16
    assert pool.bytes_held <= 1.25 * need, pool.bytes_held / need
    assert pool.allocations == allocations_after_longest, "no allocation after the longest step"


def test_pool_budget_refusal_then_trim_idle():
    b = budget(limit=3 * 65536)
    pool = HostBufferPool(pin_memory=False, budget=b)
    a = pool.acquire(65536)
    c = pool.acquire(2 * 65536)
    assert pool.acquire(65536) is None  # over the cap
    assert b.refusals >= 1
    pool.release(c)
    # idle memory of another size serves it: carved from c's chunk, nothing new held
    d = pool.acquire(65536)
    assert d is not None and d.buffer.data_ptr() == c.buffer.data_ptr() and pool.bytes_held == 3 * 65536
    pool.release(d)
    pool.release(a)
    # No free range fits 192 KiB (two separate chunks): idle chunks are given back to make room.
    e = pool.acquire(3 * 65536)
    assert e is not None and pool.bytes_held == 3 * 65536 and pool.chunks == 1
    pool.release(e)
    pool.close()
    assert b.used_bytes == 0


def test_pool_close_frees_buffers_released_later():
    b = budget()
    pool = HostBufferPool(pin_memory=False, budget=b)
    blk = pool.acquire(50_000)
    pool.close()
    assert b.used_bytes == pool.bytes_held > 0  # the chunk in use stays
    pool.release(blk)
    assert b.used_bytes == 0
    with pytest.raises(RuntimeError):
        pool.acquire(1)


def test_budget_keeps_min_free_ram():
    b = HostMemoryBudget(min_free_bytes=10 * GiB, available_fn=lambda: 12 * GiB)
    assert b.try_reserve(1 * GiB)
    assert not b.try_reserve(3 * GiB)
    assert b.headroom() == 1 * GiB  # the 1 GiB reserved since the last reading counts


def test_budget_default_min_free_is_sane():
    b = HostMemoryBudget()
    assert b.min_free_bytes >= 2 * GiB


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(limit_bytes=-1), "host_budget_bytes"),
        (dict(min_free_bytes=-5), "min_free_bytes"),
        (dict(limit_bytes="1GiB"), "host_budget_bytes"),
        (dict(limit_bytes=True), "host_budget_bytes"),
    ],
)
def test_budget_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        HostMemoryBudget(**kw)


def test_budget_release_underflow_is_an_error():
    b = budget()
    with pytest.raises(RuntimeError):
        b.release(1)


def test_host_tier_round_trip_cpu():
    pool = HostBufferPool(pin_memory=False, budget=budget())
    tier = HostTier(pool, use_streams=True)
    src = torch.randint(0, 255, (70_001,), dtype=torch.uint8)
    stored = tier.store(src)
    assert stored.copy_finished()
    src_copy = src.clone()
    src.zero_()  # the stored bytes are a copy, not a view
    loaded = tier.load(stored)
    assert torch.equal(loaded.data, src_copy)
    assert loaded.data.data_ptr() != stored.payload.buffer.data_ptr()
    tier.free(stored)
    assert pool.bytes_in_use == 0


def _cgroup_tree(tmp_path, proc_line, files):
    root = tmp_path / "cgroup"
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_line)
    return str(root), str(proc)


def test_cgroup_v2_limit_is_read_from_the_process_own_group(tmp_path):
    from offloadkit.storage.budget import cgroup_available

    root, proc = _cgroup_tree(
        tmp_path,
        "0::/slurm/job_42/step_0\n",
        {
            "memory.max": "max\n",
            "memory.current": "1\n",  # the root has no limit
            "slurm/job_42/memory.max": str(8 << 30),
            "slurm/job_42/memory.current": str(2 << 30),
            "slurm/job_42/step_0/memory.max": "max",
            "slurm/job_42/step_0/memory.current": str(2 << 30),
        },
    )
    assert cgroup_available(root, proc) == 6 << 30  # the job's limit, found from the step's group


def test_cgroup_v1_memory_controller_and_no_limit(tmp_path):
    from offloadkit.storage.budget import cgroup_available

    root, proc = _cgroup_tree(
        tmp_path,
        "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n",
        {
            "memory/memory.limit_in_bytes": str(1 << 62),
            "memory/memory.usage_in_bytes": "5",
            "memory/docker/abc/memory.limit_in_bytes": str(4 << 30),
            "memory/docker/abc/memory.usage_in_bytes": str(1 << 30),
        },
    )
    assert cgroup_available(root, proc) == 3 << 30
    root, proc = _cgroup_tree(
        tmp_path / "none", "0::/user.slice\n", {"user.slice/memory.max": "max\n", "user.slice/memory.current": "7"}
    )
    assert cgroup_available(root, proc) is None


def test_cgroup_page_cache_counts_as_free_and_the_limit_is_reported(tmp_path):
    from offloadkit.storage.budget import cgroup_limits

    root, proc = _cgroup_tree(
        tmp_path,
        "0::/job\n",
        {
            "job/memory.max": str(16 << 30),
            "job/memory.current": str(10 << 30),
            "job/memory.stat": f"anon {4 << 30}\nfile {6 << 30}\ninactive_file {5 << 30}\nfile_dirty {1 << 30}\n",
        },
    )
    assert cgroup_limits(root, proc) == (16 << 30, 10 << 30)  # 5 GiB inactive, 1 GiB of it dirty: 4 reclaimable


def test_default_reserve_follows_the_cgroup_limit_not_the_node(monkeypatch):
    from offloadkit.storage import budget as budget_module

    # A 128 GiB job on a 2 TiB node: keeping 10% of the node free (205 GiB) would refuse everything.
    monkeypatch.setattr(
        budget_module.psutil, "virtual_memory", lambda: type("vm", (), {"total": 2048 * GiB, "available": 1900 * GiB})()
    )
    monkeypatch.setattr(budget_module, "cgroup_limits", lambda *a, **k: (128 * GiB, 98 * GiB))
    b = HostMemoryBudget(ranks_per_node=1)
    assert b.min_free_bytes == int(12.8 * GiB)
    assert b.headroom() == 98 * GiB - b.min_free_bytes
    assert b.try_reserve(64 << 20)


def test_budget_reads_available_ram_rarely():
    calls = []
    b = HostMemoryBudget(min_free_bytes=0, available_fn=lambda: calls.append(1) or 64 * GiB)
    for _ in range(1000):
        b.headroom()
        assert b.try_reserve(1 << 20)
    assert len(calls) <= 3, "a psutil/cgroup read per saved tensor costs ~100 us"
    assert b.headroom() == 64 * GiB - 1000 * (1 << 20), "reservations since the reading still count"


def test_pools_sharing_a_budget_give_idle_buffers_to_each_other():
    b = budget(limit=4 * 65536)
    a_pool = HostBufferPool(pin_memory=False, budget=b)
    b_pool = HostBufferPool(pin_memory=False, budget=b)
    blocks = [a_pool.acquire(65536) for _ in range(4)]
    for blk in blocks:
        a_pool.release(blk)  # idle in pool A: the whole budget is held by A's cache
    assert b.headroom() == 0
    got = b_pool.acquire(2 * 65536)
    assert got is not None, "pool B must get room from pool A's idle buffers"
    assert a_pool.bytes_held == 2 * 65536 and b.used_bytes <= 4 * 65536


def test_ranks_on_one_node_share_its_ram(monkeypatch):
    b = HostMemoryBudget(min_free_bytes=4 * GiB, available_fn=lambda: 36 * GiB, ranks_per_node=8)
    assert b.headroom() == 4 * GiB  # (36 - 4) / 8, not the whole 32 GiB
    assert b.try_reserve(3 * GiB) and not b.try_reserve(2 * GiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert HostMemoryBudget(min_free_bytes=0, available_fn=lambda: 40 * GiB).headroom() == 10 * GiB
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert HostMemoryBudget(min_free_bytes=0, available_fn=lambda: 40 * GiB).headroom() == 40 * GiB


def test_ranks_filling_a_node_at_once_each_get_their_share():
    # Four ranks share 100 GiB above the guard and fill it together, 1 GiB at a time: each must
    # reach a quarter (what the planner gave it), not the 1/7 a share read only live leaves once
    # the others' bytes are gone from the free RAM.
    free = [104 * GiB]

    def reading():
        return free[0]

    ranks = [HostMemoryBudget(min_free_bytes=4 * GiB, available_fn=reading, ranks_per_node=4) for _ in range(4)]
    for b in ranks:
        b.REFRESH_S = -1.0  # every call reads the node's RAM, as a slow fill does
    progress = True
    while progress:
        progress = False
        for b in ranks:
            if b.try_reserve(GiB):
                free[0] -= GiB
                progress = True
    assert [b.used_bytes for b in ranks] == [25 * GiB] * 4
    assert free[0] == 4 * GiB, "the guard's RAM stays free"


def test_a_block_given_back_inside_the_pools_own_lock_waits_for_the_next_call():
    pool = HostBufferPool(False, HostMemoryBudget(min_free_bytes=0))
    block = pool.acquire(1 << 20)
    with pool._lock:  # where a garbage collection could run a finalizer
        pool.release_later(block)
    assert pool.bytes_in_use == 1 << 20, "queued, not taken under the held lock"
    small = pool.acquire(4096)
    assert pool.bytes_in_use == small.capacity, "given back by the next call"
    pool.release(small)
    pool.close()
    assert pool.bytes_held == 0
