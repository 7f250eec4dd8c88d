"""What the CUDA caching allocator held at a run's peak reservation, from its recorded history.

``start()`` records the allocator's history (Python frames of each allocation); ``summarize()``
replays the recorded events and reports, at the moment reserved memory first reached its
maximum and at the moment allocated memory did: reserved, allocated, the bytes reserved and not
allocated, and the live allocations grouped by where they were made (the first offloadkit frame,
else the first transformers or torch frame, else "no Python frame": autograd's own thread).
Allocations made before ``start()`` count as "before the recording".

    python benchmarks/full_ft_peers.py --out DIR --shapes llama-3.2-3b --modes offloadkit --memory-trace
"""

from __future__ import annotations

import collections

import torch

__all__ = ["start", "stop", "summarize"]

_GiB = 1 << 30


def start(max_entries: int = 3_000_000) -> dict:
    """Start recording; returns the allocator's figures at the start (what the replay begins from)."""
    torch.cuda.synchronize()
    base = {"reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated()}
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    return base


def stop() -> dict:
    """Stop recording; returns the snapshot with its traces."""
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snap


def _where(frames: list[dict]) -> str:
    for pick in ("offloadkit/", "transformers/", "torch/"):
        for f in frames:
            name = f.get("filename", "")
            if pick in name and "memory_trace" not in name:
                tail = name.split(pick, 1)[1]
                return f"{pick.rstrip('/')}/{tail}:{f.get('name', '?')}"
    return "no Python frame"


def summarize(snapshot: dict, base: dict, device: int = 0, top: int = 12) -> dict:
    """Replay ``snapshot``'s trace of ``device`` from ``base`` (see :func:`start`).

    Returns:
        ``{"events", "at_peak_reserved": {...}, "at_peak_allocated": {...}}``, each moment with
        reserved/allocated/unallocated GiB and its ``top`` live groups (GiB).
    """
    trace = snapshot["device_traces"][device]
    # First pass: the events at which each peak was first reached; second: the state there.
    at = {}
    for name in ("reserved", "allocated"):
        best, index = -1, -1
        for i, (res, alloc) in enumerate(_levels(trace, base)):
            level = res if name == "reserved" else alloc
            if level > best:
                best, index = level, i
        at[name] = _moment(trace[: index + 1], base, top)
    return {
        "events": len(trace),
        "at_peak_reserved": at["reserved"],
        "at_peak_allocated": at["allocated"],
    }


def _levels(trace: list[dict], base: dict):
    """(reserved, allocated) after each event."""
    reserved, allocated = base["reserved"], base["allocated"]
    for ev in trace:
        action, size = ev["action"], ev.get("size", 0)
        reserved += size if action in ("segment_alloc", "segment_map") else 0
        reserved -= size if action in ("segment_free", "segment_unmap") else 0
        allocated += size if action == "alloc" else -size if action == "free_completed" else 0
        yield reserved, allocated


def _moment(trace: list[dict], base: dict, top: int) -> dict:
    live: dict[int, tuple[int, str]] = {}
    before = base["allocated"]  # bytes allocated before the recording, not yet seen freed
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev.get("addr")] = (ev.get("size", 0), _where(ev.get("frames", [])))
        elif ev["action"] == "free_completed" and live.pop(ev.get("addr"), None) is None:
            before = max(0, before - ev.get("size", 0))
    reserved, allocated = list(_levels(trace, base))[-1] if trace else (base["reserved"], base["allocated"])
    groups: collections.Counter = collections.Counter()
    for size, where in live.values():
        groups[where] += size
    if before > 0:
        groups["before the recording"] += before
    return {
        "reserved_gib": round(reserved / _GiB, 3),
        "allocated_gib": round(allocated / _GiB, 3),
        "unallocated_gib": round((reserved - allocated) / _GiB, 3),
        "groups_gib": {k: round(v / _GiB, 3) for k, v in groups.most_common(top)},
    }
