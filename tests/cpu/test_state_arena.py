"""The ring that optimizer state fetched in backward is carved from: placement, reclaiming
in order, what a new tenant follows, and the carved tensors (bookkeeping; the copies run on
a GPU in tests/gpu/test_backward_adamw_cuda.py)."""

from __future__ import annotations

import random

import pytest
import torch

from offloadkit.optim.state_arena import ALIGN, Ring, RingSize, StateArena


def _overlap(a, b) -> bool:
    return a.start < b.end and b.start < a.end


def test_slots_are_placed_in_order_and_aligned():
    ring = Ring(10 * ALIGN)
    a, follow_a = ring.take(1)
    b, _ = ring.take(ALIGN + 1)
    assert (a.start, a.end) == (0, ALIGN) and follow_a == []
    assert (b.start, b.end) == (ALIGN, 3 * ALIGN)
    assert ring.live_bytes() == 3 * ALIGN and ring.stats.carved == 2


def test_a_tenant_in_use_is_never_passed():
    ring = Ring(4 * ALIGN)
    first, _ = ring.take(2 * ALIGN)
    ring.take(2 * ALIGN)
    assert ring.take(ALIGN) is None  # full, and the oldest is still in use
    assert ring.stats.missed == 1
    Ring.release(first, "copied back")
    slot, follow = ring.take(ALIGN)
    assert (slot.start, follow) == (0, ["copied back"])  # wraps onto the released bytes, after their copy
    assert ring.stats.wrapped == 1


def test_released_tenants_behind_one_in_use_stay_until_it_is_released():
    ring = Ring(3 * ALIGN)
    a, _ = ring.take(ALIGN)
    b, _ = ring.take(ALIGN)
    c, _ = ring.take(ALIGN)
    Ring.release(b, "b")
    Ring.release(c, "c")
    assert ring.take(ALIGN) is None  # a, the oldest, is in use: b and c are not reclaimed past it
    Ring.release(a, "a")
    slot, follow = ring.take(2 * ALIGN)
    assert (slot.start, slot.end) == (0, 2 * ALIGN) and follow == ["a", "b"]


def test_a_request_larger_than_the_ring_is_refused():
    ring = Ring(2 * ALIGN)
    assert ring.take(2 * ALIGN + 1) is None and ring.stats.missed == 1
    with pytest.raises(ValueError, match="capacity=0"):
        Ring(0)


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_never_overwrites_bytes_before_their_tenant_is_done(seed):
    """Fetch ahead, update, copy back and drop in random interleavings: a live or unreleased
    slot never shares a byte with a new one, and every byte a new slot takes was either never
    used or released with a completion that the stream of writers waited for."""
    rng = random.Random(seed)
    ring = Ring(64 * ALIGN)
    live: list = []  # in use or released but not yet reclaimed: [slot, done]
    waited: set = set()  # completions the writer stream has followed so far
    for i in range(2000):
        if live and rng.random() < 0.45:
            slot = rng.choice([s for s in live if not s.released] or [live[0]])
            if not slot.released:
                Ring.release(slot, f"done{i}")
            continue
        got = ring.take(rng.randrange(1, 20 * ALIGN))
        if got is None:
            continue
        new, follow = got
        waited.update(follow)
        assert 0 <= new.start < new.end <= ring.capacity
        for old in list(live):
            if old in ring.slots:
                assert not _overlap(old, new) or old is new
            else:  # reclaimed: its bytes may be reused, after its completion
                assert old.done in waited
                live.remove(old)
        live.append(new)
        assert ring.live_bytes() <= ring.capacity
    assert ring.stats.wrapped > 0 and ring.stats.missed > 0 and ring.stats.carved > 100


def test_the_arena_carves_aligned_views_of_one_buffer():
    arena = StateArena(8 * ALIGN, torch.device("cpu"))
    got = arena.carve({"exp_avg": ((3, 5), torch.float32), "master": ((7,), torch.float32)})
    assert got is not None
    tensors, slot, follow = got
    base = arena.buffer.data_ptr()
    for t in tensors.values():
        assert t.untyped_storage().data_ptr() == base and (t.data_ptr() - base) % ALIGN == 0
    assert tensors["exp_avg"].shape == (3, 5) and tensors["master"].dtype == torch.float32
    tensors["exp_avg"].fill_(1.0)
    tensors["master"].fill_(2.0)
    assert tensors["exp_avg"].sum() == 15 and tensors["master"].sum() == 14  # no overlap
    assert (slot.start, slot.end, follow) == (0, 2 * ALIGN, [])


class _Copy:
    """A copy back that completes when the test says so."""

    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        return self.finished


def test_the_next_ring_holds_what_the_pass_held_at_once():
    size = RingSize(item_limit=10 * ALIGN)
    copies = []
    for _ in range(6):  # each state fetched, updated, sent back; two copies back in flight at most
        size.taken(4 * ALIGN)
        copy = _Copy()
        size.stored(copy, 4 * ALIGN)
        copies.append(copy)
        if len(copies) > 2:
            copies[-3].finished = True
    size.taken(2 * ALIGN)
    size.dropped(2 * ALIGN)  # fetched ahead and never used
    # At most three states were held at once (two going back, one taken), plus one for a wrap.
    assert size.end_pass() == 3 * 4 * ALIGN + 4 * ALIGN
    assert size.end_pass() == 0  # a pass that took nothing measures nothing


def test_states_past_the_item_limit_do_not_size_the_ring():
    size = RingSize(item_limit=ALIGN)
    assert size.counts(ALIGN) and not size.counts(ALIGN + 1) and not size.counts(0)


class _Event:
    def __init__(self, log: list, what: str) -> None:
        self.what, self.finished = what, False
        log.append(self)

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.finished = True


class _Stream:
    def __init__(self, log: list) -> None:
        self.log = log
        self.waited: list = []

    def wait_event(self, event) -> None:
        self.waited.append(event)

    def record_event(self):
        return _Event(self.log, "compute")


@pytest.fixture
def stubbed_copies(monkeypatch):
    """StateCopies over CPU tensors: streams and copies stubbed (a copy is done when the test
    says so), the arena's buffer in host memory; the bookkeeping is the library's."""
    import contextlib

    import offloadkit.optim.state_copies as sc

    log: list = []
    compute, h2d, d2h = _Stream(log), _Stream(log), _Stream(log)
    monkeypatch.setattr(sc, "copy_stream", lambda device, kind: h2d if kind == "h2d_bulk" else d2h)
    monkeypatch.setattr(sc.torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(sc.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    monkeypatch.setattr(sc, "order_after", lambda stream, completion: stream.wait_event(completion))

    def queue_copy(dst, src, *, stream, block, after):
        dst.copy_(src)
        return _Event(log, "d2h" if stream is d2h else "h2d")

    monkeypatch.setattr(sc, "queue_copy", queue_copy)
    return sc, log, h2d


def _pass(copies, params, log, finish_copies_back: bool) -> None:
    for p in params:
        got = copies.fetch(p)
        copies.store(p, got)
        if finish_copies_back:
            for e in log:
                e.finished = True
    copies.end_pass()


def test_a_pass_carves_its_state_from_a_ring_sized_by_the_last_pass(stubbed_copies):
    sc, log, h2d = stubbed_copies
    params = [torch.zeros(256) for _ in range(8)]  # 1 KiB of fp32 state each: 2 aligned slots
    item = 2 * ALIGN
    states = {id(p): {"exp_avg": torch.full((256,), float(i))} for i, p in enumerate(params)}
    copies = sc.StateCopies(lambda p: (states[id(p)], ("exp_avg",)), window_bytes=64 * ALIGN)
    copies.set_groups([[p] for p in params], ahead=1)  # one parameter fetched ahead
    _pass(copies, params, log, finish_copies_back=True)  # first pass: no order, the allocator
    assert copies.arena_stats.carved == 0
    assert copies._ring_bytes[torch.device("cpu")] == 2 * item  # one state held at a time, and one for a wrap
    _pass(copies, params, log, finish_copies_back=True)
    stats = copies.arena_stats
    # Two states at once (one updated, one fetched ahead) in a ring of two: it wraps, and
    # never finds its oldest tenant still in use.
    assert (stats.carved, stats.missed) == (8, 0) and stats.wrapped > 0, stats
    assert copies._ring_bytes[torch.device("cpu")] == 3 * item
    _pass(copies, params, log, finish_copies_back=False)  # copies back slower than updates
    assert (copies.arena_stats.carved, copies.arena_stats.missed) == (16, 0)
    # A reused slot's copy in waits on the device for its last tenant's copy back, unfinished.
    assert any(e.what == "d2h" and not e.finished for e in h2d.waited)
    assert copies._ring_bytes[torch.device("cpu")] == 9 * item  # nothing came back: all eight held at once
    copies.wait_all()
    for i, p in enumerate(params):
        assert torch.equal(states[id(p)]["exp_avg"], torch.full((256,), float(i)))  # round trips exact


def test_a_state_the_update_made_does_not_shrink_the_next_ring(stubbed_copies):
    """SGD's first momentum buffer is made by the update and only copied back: it was never
    counted as taken, so its copy back must not be counted as leaving."""
    sc, log, _ = stubbed_copies
    params = [torch.zeros(256) for _ in range(4)]
    states = {id(p): {"momentum_buffer": torch.zeros(256)} for p in params}
    copies = sc.StateCopies(lambda p: (states[id(p)], ("momentum_buffer",)), window_bytes=64 * ALIGN)
    for p in params:
        copies.store(p, {"momentum_buffer": torch.ones(256)})
    for e in log:
        e.finished = True
    _pass(copies, params, log, finish_copies_back=False)
    assert all(size.live >= 0 for size in copies._ring_sizes.values())
    assert copies._ring_bytes[torch.device("cpu")] == 5 * 2 * ALIGN  # the four held at once, plus one for a wrap


def test_an_update_that_raised_leaves_nothing_counted(stubbed_copies):
    """An update that raises between fetch and store (the loop skips that step and goes on):
    the step's end forgets that fetch (as would the parameter's next fetch), so later rings do
    not grow with each failure."""
    sc, log, _ = stubbed_copies
    params = [torch.zeros(256) for _ in range(8)]
    states = {id(p): {"exp_avg": torch.zeros(256)} for p in params}
    copies = sc.StateCopies(lambda p: (states[id(p)], ("exp_avg",)), window_bytes=64 * ALIGN)
    copies.set_groups([[p] for p in params], ahead=1)
    _pass(copies, params, log, finish_copies_back=True)
    _pass(copies, params, log, finish_copies_back=True)
    ring = copies._ring_bytes[torch.device("cpu")]
    for _ in range(3):
        for i, p in enumerate(params):
            got = copies.fetch(p)
            if i == 3:
                break  # its update raised: no store
            copies.store(p, got)
            for e in log:
                e.finished = True
        copies.end_pass()  # the step ends: nothing is being updated, the failed fetch is forgotten
        _pass(copies, params, log, finish_copies_back=True)
        assert copies._ring_bytes[torch.device("cpu")] == ring
    size = copies._ring_sizes[torch.device("cpu")]
    size._settle()
    assert size.live == 0 and copies._ring_bytes[torch.device("cpu")] == ring


def test_each_device_has_a_ring_of_what_it_held(stubbed_copies, monkeypatch):
    """Parameters on two devices (cpu and meta stand in), updated in turn, copies back slower
    than the updates: each device's arena holds what that device held at once."""
    sc, log, h2d = stubbed_copies

    def queue_copy(dst, src, *, stream, block, after):
        if "meta" not in (dst.device.type, src.device.type):
            dst.copy_(src)
        return _Event(log, "h2d" if stream is h2d else "d2h")

    monkeypatch.setattr(sc, "queue_copy", queue_copy)
    params = [torch.zeros(256, device="cpu" if i % 2 == 0 else "meta") for i in range(8)]
    states = {id(p): {"exp_avg": torch.zeros(256)} for p in params}
    copies = sc.StateCopies(lambda p: (states[id(p)], ("exp_avg",)), window_bytes=64 * ALIGN)
    _pass(copies, params, log, finish_copies_back=False)  # nothing comes back: four a device at once
    assert copies._ring_bytes == {torch.device("cpu"): 5 * 2 * ALIGN, torch.device("meta"): 5 * 2 * ALIGN}
