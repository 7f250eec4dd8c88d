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

``--kernels fa4,flex`` adds two kernels outside SDPA's defaults, each run on the inputs the
default kernel ran on at that length and held against its output and input gradients (the
largest difference relative to the default's largest magnitude; bf16 kernels differ by
rounding, not by more):

- ``fa4``: SDPA's flash backend with FlashAttention-4 activated through torch's FA4 provider,
  as ``attention_kernel: fa4`` does (needs ``flash-attn-4`` and its CuTe DSL runtime, compute
  capability 9.0 or 10.0). It stays active for the rest of the
  process, so these cases run last;
- ``flex``: ``flex_attention`` compiled with a causal block mask.

A kernel that cannot run here (not installed, this GPU, these shapes) is recorded with why.

    PYTHONPATH=$PWD python3 benchmarks/attention_kernels.py --seq 65536,262144,524288 --out DIR
    PYTHONPATH=$PWD python3 benchmarks/attention_kernels.py --seq 65536,262144 --kernels fa4,flex --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from offloadkit.bench.provenance import provenance

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


# Kernels outside SDPA's own backends (see the module's docstring).
EXTRA = ("fa4", "flex")


def _flex_forward(seq: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, qi, kvi: qi >= kvi, None, None, seq, seq, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def max_rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference from ``ref``, relative to ``ref``'s largest magnitude."""
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def _run(
    seq: int,
    backend: str | None,
    gqa: bool,
    repeats: int,
    layout: str = "bhsd",
    groups: int = 1,
    reference: dict | None = None,
) -> dict:
    """One case. With ``reference`` (a dict), the inputs are seeded by the length: an empty
    dict receives this case's output and input gradients, a filled one is compared with them."""
    from offloadkit.longctx.attention_groups import grouped_attention

    torch.cuda.empty_cache()
    if reference is not None:
        torch.manual_seed(seq)

    def tensor(heads: int) -> torch.Tensor:
        if layout == "bshd":  # projections seen as [B, heads, S, D], as attention modules call SDPA
            return torch.randn(1, seq, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return torch.randn(1, heads, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    q, k, v = (tensor(h).requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS))
    grads_in = (
        torch.randn(1, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16) if reference is not None else None
    )
    out: dict = {"seq": seq, "backend": backend or "default", "gqa": gqa, "layout": layout, "groups": groups}
    try:
        flex = _flex_forward(seq) if backend == "flex" else None
        if backend == "fa4":
            from torch.nn.attention import activate_flash_attention_impl

            from offloadkit.runtime.flash_providers import register_fa4

            # SDPA's flash backend runs FlashAttention-4 from here on, through the interface
            # that returns what torch's provider unpacks (offloadkit/runtime/flash_providers.py).
            activate_flash_attention_impl(register_fa4() or "FA4")
    except Exception as exc:  # not installed, or not for this GPU
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return out
    pinned = {"fa4": SDPBackend.FLASH_ATTENTION, "flex": None}.get(backend or "", BACKENDS.get(backend or ""))
    ctx = sdpa_kernel([pinned]) if pinned is not None else torch.enable_grad()

    def forward():
        if flex is not None:
            if gqa:
                return flex(q, k, v)
            return flex(q, *(t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v)))
        if groups > 1:
            return grouped_attention(groups, q, k, v, is_causal=True, enable_gqa=True)
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        kr, vr = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)

    fwd_ms, bwd_ms, workspace = [], [], 0
    try:
        with ctx:
            for _ in range(repeats + 1):
                q.grad = k.grad = v.grad = None
                a, b, g, c = (torch.cuda.Event(enable_timing=True) for _ in range(4))
                torch.cuda.synchronize()
                a.record()
                o = forward()
                b.record()
                # The output's own layout, as the layer above hands it back (seeded: the reference's values).
                grad = torch.randn_like(o) if grads_in is None else torch.empty_like(o).copy_(grads_in)
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
                last = (o.detach(), q.grad, k.grad, v.grad)
                del o, grad
    except Exception as exc:  # a backend that does not take these inputs (or cannot compile) says so
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return out
    if reference is not None:
        if reference:
            out["max_rel_diff_vs_default"] = max(max_rel_diff(a, b) for a, b in zip(last, reference["tensors"]))
        else:
            reference["tensors"] = last
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
    ap.add_argument(
        "--kernels",
        default="",
        help="comma-separated kernels outside SDPA's own (fa4, flex): each held against the default kernel",
    )
    ap.add_argument("--out", default="attention-results")
    args = ap.parse_args(argv)
    seqs = [int(s) for s in args.seq.split(",")]
    extra = [k for k in args.kernels.split(",") if k]
    if set(extra) - set(EXTRA):
        raise SystemExit(f"--kernels {args.kernels}: choose from {', '.join(EXTRA)}")
    if extra:
        # The default kernel first at each length (the reference), FA4 after everything else.
        cases = [(seq, None, True, {}) for seq in seqs]
        # Each with the key/value heads as they are and repeated (what models do where a kernel
        # takes no grouped heads).
        cases += [
            (seq, k, gqa, {}) for k in sorted(extra, key=lambda k: k == "fa4") for seq in seqs for gqa in (True, False)
        ]
    elif args.layouts:
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
    references: dict[int, dict] = {seq: {} for seq in seqs}
    for seq, backend, gqa, variant in cases:
        t0 = time.perf_counter()
        if extra:
            variant = dict(variant, reference=references[seq])
        row = _run(seq, backend, gqa, args.repeats, **variant)
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    report["provenance"] = provenance()
    name = "attention-layouts.json" if args.layouts else "attention-kernels.json"
    if extra:
        name = f"attention-kernels-{'-'.join(extra)}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
