"""Which SDPA kernel runs a long causal attention, how fast, and what its backward holds.

For the Llama-3-8B attention shape (32 query heads, 8 key/value heads, head_dim 128, bf16,
causal, no mask: what Hugging Face's SDPA path calls at long context), each CUDA backend
(flash, memory-efficient, cuDNN) is timed forward and backward at several lengths, with the
key/value heads passed as they are (``enable_gqa=True``, what transformers does without a
mask) or repeated to the query heads first (``repeat_kv``). Recorded per run: the forward and
backward time (CUDA events, median of ``--repeats``), TFLOP/s (causal: 2 S^2 heads x head_dim
forward, twice that backward), and the GPU bytes per token the backward allocates beyond its
inputs and outputs (its workspace: the planner's attention transient). Also which backend
the default dispatch picks (``torch.backends.cuda.*_sdp_enabled`` as they are).

    PYTHONPATH=$PWD python3 benchmarks/attention_kernels.py --seq 65536,262144,524288 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def _run(seq: int, backend: str | None, gqa: bool, repeats: int, layout: str = "bhsd", groups: int = 1) -> dict:
    from offloadkit.longctx.attention_groups import grouped_attention

    torch.cuda.empty_cache()

    def tensor(heads: int) -> torch.Tensor:
        if layout == "bshd":  # projections seen as [B, heads, S, D], as attention modules call SDPA
            return torch.randn(1, seq, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return torch.randn(1, heads, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    q, k, v = (tensor(h).requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS))
    ctx = sdpa_kernel([BACKENDS[backend]]) if backend else torch.enable_grad()

    def forward():
        if groups > 1:
            return grouped_attention(groups, q, k, v, is_causal=True, enable_gqa=True)
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        kr, vr = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)

    fwd_ms, bwd_ms, workspace = [], [], 0
    out: dict = {"seq": seq, "backend": backend or "default", "gqa": gqa, "layout": layout, "groups": groups}
    try:
        with ctx:
            for _ in range(repeats + 1):
                q.grad = k.grad = v.grad = None
                a, b, g, c = (torch.cuda.Event(enable_timing=True) for _ in range(4))
                torch.cuda.synchronize()
                a.record()
                o = forward()
                b.record()
                grad = torch.randn_like(o)  # the output's own layout, as the layer above hands it back
                torch.cuda.synchronize()
                g.record()  # the backward's time starts after the gradient is made
                live = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                o.backward(grad)
                c.record()
                torch.cuda.synchronize()
                # Beyond what was live and the three input gradients: the backward's own bytes.
                grads = sum(t.grad.numel() * t.grad.element_size() for t in (q, k, v))
                workspace = max(workspace, torch.cuda.max_memory_allocated() - live - grads)
                fwd_ms.append(a.elapsed_time(b))
                bwd_ms.append(g.elapsed_time(c))
                del o, grad
    except RuntimeError as exc:  # a backend that does not take these inputs says so
        out["error"] = str(exc).split("\n")[0][:200]
        return out
    fwd, bwd = sorted(fwd_ms[1:])[len(fwd_ms[1:]) // 2], sorted(bwd_ms[1:])[len(bwd_ms[1:]) // 2]
    flops = 2.0 * seq * seq * HEADS * HEAD_DIM  # causal forward
    out.update(
        forward_ms=round(fwd, 2),
        backward_ms=round(bwd, 2),
        forward_tflops=round(flops / fwd / 1e9, 1),
        backward_tflops=round(2 * flops / bwd / 1e9, 1),
        step_tflops=round(3 * flops / (fwd + bwd) / 1e9, 1),
        backward_workspace_bytes_per_token=round(workspace / seq, 1),
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", default="65536,262144")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--repeat-kv-up-to", type=int, default=1 << 18, help="longest seq also run with repeat_kv")
    ap.add_argument(
        "--layouts",
        action="store_true",
        help="default kernel only: contiguous [B, H, S, D] against projections seen as [B, H, S, D] from "
        "[B, S, H, D] memory, whole and over 8 key/value head groups",
    )
    ap.add_argument("--out", default="attention-results")
    args = ap.parse_args(argv)
    seqs = [int(s) for s in args.seq.split(",")]
    if args.layouts:
        cases = [
            (seq, None, True, dict(layout=lo, groups=g)) for seq in seqs for lo in ("bhsd", "bshd") for g in (1, 8)
        ]
    else:
        cases = [
            (seq, backend, gqa, {})
            for seq in seqs
            for backend in (None, *BACKENDS)
            for gqa in ((True, False) if seq <= args.repeat_kv_up_to else (True,))
        ]
    rows = []
    for seq, backend, gqa, variant in cases:
        t0 = time.perf_counter()
        row = _run(seq, backend, gqa, args.repeats, **variant)
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    name = "attention-layouts.json" if args.layouts else "attention-kernels.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
