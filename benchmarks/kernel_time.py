"""Where a step's GPU time goes: one step under ``torch.profiler``, its kernels grouped.

Groups, by kernel name: attention (SDPA's fused kernels: cuDNN, flash, memory-efficient),
gemm (cuBLAS/cuBLASLt/CUTLASS matmuls), copy (memcpy/memset), other (elementwise,
reductions, casts, Triton kernels). Per CUDA stream: busy seconds (the union of its kernels'
intervals); the compute stream is the one with the most kernel time other than copies, and
its idle time inside the step is what the GPU waited for (copies, the host, synchronizations).

With the host's calls recorded too (``launches``), each copy that ran while the compute
stream waited carries its size and how long it sat queued: from the host's call that asked
for it to its start on the GPU (a copy asked for late starts at once; one asked for early
but queued behind other work starts later).

Used by ``benchmarks/capacity.py --kernel-breakdown``.
"""

from __future__ import annotations

import re
from collections import defaultdict

GROUPS = (
    ("attention", re.compile(r"sdpa|flash|fmha|attention|attn", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_|ampere_|wgmma|splitk", re.I)),
    ("copy", re.compile(r"memcpy|memset", re.I)),
)


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return "other"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


# The trace's categories of the host's CUDA calls and of device copies (Kineto's names, and
# those of its older releases).
_RUNTIME = ("cuda_runtime", "cuda_driver", "Runtime")
_MEMCPY = ("gpu_memcpy", "Memcpy")


def copy_launches(trace: dict) -> dict[int, list[tuple[float, float, int, float]]]:
    """Per stream, its copies in a Chrome trace of the profile (``export_chrome_trace``), in
    start order: (start us, duration us, bytes, ms from the host's call to the start)."""
    asked = {}
    for e in trace.get("traceEvents", []):
        if e.get("cat") in _RUNTIME and "correlation" in e.get("args", {}):
            asked[e["args"]["correlation"]] = e["ts"]
    out: dict[int, list[tuple[float, float, int, float]]] = defaultdict(list)
    for e in trace.get("traceEvents", []):
        if e.get("cat") not in _MEMCPY:
            continue
        args = e.get("args", {})
        called = asked.get(args.get("correlation"))
        queued = round((e["ts"] - called) / 1e3, 3) if called is not None else None
        out[int(args.get("stream", -1))].append((e["ts"], e.get("dur", 0.0), int(args.get("bytes", 0)), queued))
    return {stream: sorted(copies) for stream, copies in out.items()}


def _copy_info(per_stream: dict[int, list], launches: dict | None) -> dict[int, tuple[int, float]]:
    """id(event) -> (bytes, ms queued) for each copy the trace names: a stream's copies are
    paired with the trace's in start order, where both count the same copies of the same
    durations (else that stream's are left unnamed)."""
    info: dict[int, tuple[int, float]] = {}
    for stream, evs in per_stream.items():
        copies = sorted((e for e in evs if e.name.startswith("Memcpy")), key=lambda e: e.time_range.start)
        traced = (launches or {}).get(stream, [])
        if not copies or len(copies) != len(traced):
            continue
        durations = [e.time_range.end - e.time_range.start for e in copies]
        if any(abs(d - t[1]) > 2.0 for d, t in zip(durations, traced)):
            continue
        for e, (_, _, nbytes, queued) in zip(copies, traced):
            info[id(e)] = (nbytes, queued)
    return info


def _gaps(per_stream: dict[int, list], compute: int, top: int = 8, launches: dict | None = None) -> dict:
    """The compute stream's longest idle gaps and, for each, the last kernel or copy each other
    stream finished inside it (what the compute stream most likely waited for)."""
    info = _copy_info(per_stream, launches)
    kernels = sorted(per_stream[compute], key=lambda e: e.time_range.start)
    t0 = kernels[0].time_range.start
    found, last = [], kernels[0]
    for after in kernels[1:]:
        a, b = last.time_range.end, after.time_range.start
        if b - a > 100:  # microseconds
            found.append((b - a, a, b, last, after))
        if after.time_range.end > last.time_range.end:
            last = after  # a short kernel inside a long one's interval ends no gap
    longest = []
    for length, a, b, before, after in sorted(found, key=lambda g: -g[0])[:top]:
        ended, in_flight = {}, {}
        for stream, evs in per_stream.items():
            if stream == compute:
                continue
            inside = [e for e in evs if a < e.time_range.end <= b + 5]
            if inside:
                last = max(inside, key=lambda e: e.time_range.end)
                ended[str(stream)] = last.name[:60]
            # Everything the other stream ran while the compute stream waited: a copy queued
            # behind others there shows as several, the first started before the gap.
            overlapping = sorted(
                (e for e in evs if e.time_range.end > a and e.time_range.start < b), key=lambda e: e.time_range.start
            )
            if overlapping:
                in_flight[str(stream)] = [
                    [
                        e.name[:32],
                        round((e.time_range.start - a) / 1e3, 3),
                        round((e.time_range.end - e.time_range.start) / 1e3, 3),
                        # A copy the trace names: its MiB and the ms it sat queued.
                        *((round(info[id(e)][0] / 2**20, 1), info[id(e)][1]) if id(e) in info else ()),
                    ]
                    for e in overlapping[:8]
                ]
        longest.append(
            {
                "at_s": round((a - t0) / 1e6, 4),
                "ms": round(length / 1e3, 3),
                "before": before.name[:60],
                "after": after.name[:60],
                "ended_inside": ended,
                # Per other stream: [name, start ms from the gap's start, ms] of what ran in
                # it, and for a copy the trace names, [..., MiB, ms from its call to its start].
                "in_flight": in_flight,
            }
        )
    return {
        "compute_gaps_over_100us": len(found),
        "compute_gaps_over_100us_s": round(sum(g[0] for g in found) / 1e6, 3),
        "compute_longest_gaps": longest,
    }


def breakdown(events, top: int = 12, launches: dict | None = None) -> dict:
    """Seconds per group on the compute stream, busy seconds per stream, the longest kernels.

    Args:
        events: ``prof.events()`` of a profile with CUDA activity.
        top: how many kernel names to list.
        launches: :func:`copy_launches` of the same profile, to size the copies in the gaps.
    """
    from torch.autograd import DeviceType

    per_stream: dict[int, list] = defaultdict(list)
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        per_stream[int(getattr(e, "device_resource_id", 0))].append(e)
    if not per_stream:
        return {"note": "no CUDA kernels recorded"}
    busy = {s: _union([(e.time_range.start, e.time_range.end) for e in evs]) / 1e6 for s, evs in per_stream.items()}

    def kernel_time(stream: int) -> float:
        return sum(e.time_range.end - e.time_range.start for e in per_stream[stream] if group_of(e.name) != "copy")

    # The stream that runs the most kernels other than copies: in a copy-bound step the side
    # stream's copies may keep it busier.
    compute = max(per_stream, key=kernel_time)
    kernels = per_stream[compute]
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e6
    groups: dict[str, float] = defaultdict(float)
    names: dict[str, float] = defaultdict(float)
    for e in kernels:
        seconds = (e.time_range.end - e.time_range.start) / 1e6
        groups[group_of(e.name)] += seconds
        names[e.name[:90]] += seconds
    return {
        **_gaps(per_stream, compute, launches=launches),
        "compute_stream": compute,
        "compute_span_s": round(span, 3),
        "compute_busy_s": round(busy[compute], 3),
        "compute_idle_s": round(span - busy[compute], 3),
        "groups_s": {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "streams_busy_s": {str(s): round(v, 3) for s, v in busy.items()},
        "top_kernels_s": [[n, round(v, 3)] for n, v in sorted(names.items(), key=lambda kv: -kv[1])[:top]],
    }


def profile_step(step, launches: bool = False) -> dict:
    """Run ``step()`` once under the profiler (CUDA kernels, no shapes or stacks) and return
    :func:`breakdown` with the wall time. ``launches``: record the host's CUDA calls too, to
    size the copies in the gaps and say when each was asked for; off by default, since the
    host then runs slower and its lead over the GPU, which the gaps depend on, shrinks."""
    import json
    import os
    import tempfile
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if launches else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    copies = None
    if launches:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            try:
                prof.export_chrome_trace(path)
                with open(path) as f:
                    copies = copy_launches(json.load(f))
            except (OSError, ValueError, RuntimeError):
                pass  # the breakdown stands without the copies' sizes
    out = breakdown(prof.events(), launches=copies)
    out["wall_s"] = round(wall, 3)
    return out
