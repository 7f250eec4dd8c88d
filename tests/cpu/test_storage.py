"""Host buffer pool, size classes, host-memory budget, RAM tier (CPU paths)."""

import pytest
import torch

from offloadkit.storage import HostBufferPool, HostMemoryBudget, HostTier, size_class

GiB = 1 << 30


def budget(limit=None, available=64 * GiB, min_free=0):
    return HostMemoryBudget(limit_bytes=limit, min_free_bytes=min_free, available_fn=lambda: available)


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 10_000, 1 << 20, (1 << 20) + 1, 123_456_789])
def test_size_class_bounds(n):
    c = size_class(n)
    assert c >= n and c % 4096 == 0
    assert c <= max(4096, n + n // 16 + 4096)


def test_size_class_is_monotonic_and_shares_nearby_sizes():
    sizes = list(range(1, 300_000, 997))
    classes = [size_class(n) for n in sizes]
    assert classes == sorted(classes)
    assert size_class(1_000_000) == size_class(1_000_100)


def test_pool_reuses_buffers_and_accounts_bytes():
    b = budget()
    pool = HostBufferPool(pin_memory=False, budget=b)
    blk = pool.acquire(10_000)
    assert blk.capacity == size_class(10_000) and not blk.pinned
    assert pool.bytes_in_use == blk.capacity == b.used_bytes
    pool.release(blk)
    assert pool.bytes_in_use == 0 and pool.bytes_idle == blk.capacity
    again = pool.acquire(9_999)
    assert again is blk and pool.allocations == 1 and pool.reuses == 1
    pool.release(again)
    assert pool.trim() == blk.capacity
    assert b.used_bytes == 0 and pool.bytes_held == 0


def test_pool_budget_refusal_then_trim_idle():
    b = budget(limit=3 * 65536)
    pool = HostBufferPool(pin_memory=False, budget=b)
    a = pool.acquire(65536)
    c = pool.acquire(2 * 65536)
    assert pool.acquire(65536) is None  # over the cap
    assert b.refusals >= 1
    pool.release(c)
    # an idle buffer of another class is given back to make room
    d = pool.acquire(65536)
    assert d is not None and pool.bytes_held == 2 * 65536
    pool.release(a)
    pool.release(d)
    pool.close()
    assert b.used_bytes == 0


def test_pool_close_frees_buffers_released_later():
    b = budget()
    pool = HostBufferPool(pin_memory=False, budget=b)
    blk = pool.acquire(50_000)
    pool.close()
    assert b.used_bytes == blk.capacity
    pool.release(blk)
    assert b.used_bytes == 0
    with pytest.raises(RuntimeError):
        pool.acquire(1)


def test_budget_keeps_min_free_ram():
    b = HostMemoryBudget(min_free_bytes=10 * GiB, available_fn=lambda: 12 * GiB)
    assert b.try_reserve(1 * GiB)
    assert not b.try_reserve(3 * GiB)
    assert b.headroom() == 2 * GiB


def test_budget_default_min_free_is_sane():
    b = HostMemoryBudget()
    assert b.min_free_bytes >= 2 * GiB


@pytest.mark.parametrize("kw, field", [(dict(limit_bytes=-1), "host_budget_bytes"), (dict(min_free_bytes=-5), "min_free_bytes")])
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


def test_cgroup_limit_is_respected(tmp_path):
    from offloadkit.storage.budget import _cgroup_available

    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text("8589934592\n")
    usage.write_text("2147483648\n")
    assert _cgroup_available([(str(limit), str(usage))]) == 6 << 30
    limit.write_text("max\n")
    assert _cgroup_available([(str(limit), str(usage))]) is None
    assert _cgroup_available([(str(tmp_path / "missing"), str(usage))]) is None


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
