"""Where a step's GPU time goes: one step under ``torch.profiler``, its kernels grouped.

Groups, by kernel name: attention (SDPA's fused kernels: cuDNN, flash, memory-efficient),
gemm (cuBLAS/cuBLASLt/CUTLASS matmuls), copy (memcpy/memset), other (elementwise,
reductions, casts, Triton kernels). Per CUDA stream: busy seconds (the union of its kernels'
intervals); the compute stream is the one with the most kernel time other than copies, and
its idle time inside the step is what the GPU waited for (copies, the host, synchronizations).

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


def breakdown(events, top: int = 12) -> dict:
    """Seconds per group on the compute stream, busy seconds per stream, the longest kernels.

    Args:
        events: ``prof.events()`` of a profile with CUDA activity.
        top: how many kernel names to list.
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
        "compute_stream": compute,
        "compute_span_s": round(span, 3),
        "compute_busy_s": round(busy[compute], 3),
        "compute_idle_s": round(span - busy[compute], 3),
        "groups_s": {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "streams_busy_s": {str(s): round(v, 3) for s, v in busy.items()},
        "top_kernels_s": [[n, round(v, 3)] for n, v in sorted(names.items(), key=lambda kv: -kv[1])[:top]],
    }


def profile_step(step) -> dict:
    """Run ``step()`` once under the profiler (CUDA kernels only, no shapes or stacks) and
    return :func:`breakdown` with the wall time."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    out = breakdown(prof.events())
    out["wall_s"] = round(wall, 3)
    return out
