"""Throughputs of this machine, timed: what :meth:`Budgets.measure` puts in :class:`Rates`.

- ``attention``: the model's causal SDPA call, forward and backward, through the kernel
  SDPA picks by default (named in the result).
- ``layer linears``: one decoder layer without its attention (norms, the seven linears with
  their LoRA adapters or weight gradients, SiLU gating, residual adds), forward and backward
  at a long-context tile's token count. Counted in the planner's linear FLOPs, so the norms,
  activations and adapters ride on the rate as they do in a step.
- ``pcie``: a pinned copy each way (the slower one).
- ``disk``: an O_DIRECT write and read in the spill directory.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Callable

import torch

from offloadkit.longctx.attention_groups import grouped_attention

__all__ = [
    "attention_rate",
    "linear_rate",
    "layer_linear_flops",
    "pcie_rate",
    "disk_rates",
    "ATTENTION_PROBE_TOKENS",
    "LINEAR_PROBE_TOKENS",
]

# Tokens of the attention timing: where a step starts to be attention-bound. The forward's
# rate falls with length (cuDNN on an H200: 632 TFLOP/s at 64K, 522 at 256K; the backward
# holds 430), so a shorter probe overstates a long step's. About a second.
ATTENTION_PROBE_TOKENS = 1 << 17
# Tokens of the layer-linear timing: the size of a tiled MLP's or projection's shard at long
# context (offloadkit.planning.memory.auto_mlp_shards keeps shards near this).
LINEAR_PROBE_TOKENS = 1 << 13


def _median_time(fn, repeats: int = 3) -> float:
    """Median wall time of ``fn`` over ``repeats`` synchronized runs after the first."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def attention_rate(
    shape, tokens: int = ATTENTION_PROBE_TOKENS, groups: int = 1, kernel: str = "auto"
) -> tuple[float, str]:
    """Causal SDPA forward and backward with the model's heads, called as a Llama-family
    attention module calls it: query, key and value are ``[B, S, heads, D]`` projections seen
    as ``[B, heads, S, D]``, key/value heads as they are (no mask), over ``groups`` key/value
    head groups (:func:`offloadkit.longctx.attention_groups.grouped_attention`, what long plans use),
    with the attention kernel ``kernel`` (``attention_kernel``'s values; auto: PyTorch's choice).

    Returns:
        (executed FLOP/s counting 2 S^2 heads x head_dim forward and twice that backward,
        the kernel that ran).
    """
    if kernel != "auto":
        from offloadkit.kernels.attention import running

        with running(kernel):
            rate, _ = attention_rate(shape, tokens, groups)
        return rate, kernel
    import torch.nn.functional as F

    from offloadkit.runtime.attention_ops import sdpa_backend

    gqa = shape.kv_heads != shape.heads

    def tensor(heads: int) -> torch.Tensor:
        projected = torch.randn(1, tokens, heads, shape.head_dim, device="cuda", dtype=torch.bfloat16)
        return projected.transpose(1, 2).requires_grad_()

    q, k, v = tensor(shape.heads), tensor(shape.kv_heads), tensor(shape.kv_heads)
    backend = sdpa_backend(q, k, v, is_causal=True, enable_gqa=gqa)

    def run():
        out = grouped_attention(groups, q, k, v, is_causal=True, enable_gqa=gqa)  # None: one group
        if out is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        # Random values, as a step's gradients are: the kernels run measurably faster on
        # constant data (a gradient of ones gave an H100's backward 505 TFLOP/s, 390 in a step).
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))

    seconds = _median_time(run, repeats=2)
    run = None  # drops the closure's tensors before the cache is emptied
    q = k = v = None
    torch.cuda.empty_cache()
    return 3 * 2.0 * tokens * tokens * shape.heads * shape.head_dim / seconds, backend


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # As Llama-family models compute it: in fp32, cast back before the weight.
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def layer_linear_flops(shape, lora_rank: int, tokens: int) -> int:
    """One layer's linear FLOPs over ``tokens``, forward and backward, as the planner counts
    them (:func:`offloadkit.planning.timing.step_flops`): 2 x weights forward, as much again
    for the input gradients, as much again for a full fine-tune's weight gradients; LoRA
    adapters 2 x forward and 4 x backward."""
    layer_linear = sum(a * b for a, b in shape.linears)
    adapters = sum(lora_rank * (a + b) for a, b in shape.linears)
    return 2 * layer_linear * tokens * (2 if lora_rank else 3) + 6 * adapters * tokens


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotary embedding as Llama-family models apply it: halves swapped through a concatenation.
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def linear_rate(
    shape,
    lora_rank: int,
    tokens: int = LINEAR_PROBE_TOKENS,
    device: str = "cuda",
    adapter_dtype=torch.float32,
    fused_lora: bool = False,
    liger_kernels: bool = False,
) -> float:
    """One decoder layer's work outside attention, forward and backward, in the planner's
    linear FLOP/s (:func:`offloadkit.planning.timing.step_flops`'s count for one layer).

    What a Llama-family layer under PEFT runs around its matmuls rides on the rate: the norms
    in fp32, the rotary embedding of queries and keys, SiLU gating, residual adds, and each
    adapter as PEFT computes it (input cast to the adapters' dtype, fp32 by default, scaled
    and added, cast back). The rotated queries stand in for attention's output (same width),
    so the output projection's input is real; the rotated keys and the values get their
    gradients directly.

    Args:
        shape: a :class:`~offloadkit.planning.ModelShape`.
        lora_rank: LoRA rank on every linear (frozen weights: input gradients only); 0 for a
            full fine-tune (weight gradients too).
        tokens: tokens per call.
        device: where to run it.
        adapter_dtype: the LoRA weights' dtype.
        fused_lora: each adapter as ``fused_lora: true`` computes it
            (:func:`offloadkit.lora.lora_linear`) instead of PEFT's way.
        liger_kernels: the norms and the SiLU gating as Liger's kernels compute them
            (``liger_rms_norm``, ``liger_glu_activation``; needs liger-kernel and a GPU).
    """
    import torch.nn.functional as F

    from offloadkit.lora import lora_linear

    dev, dt = device, torch.bfloat16
    full = not lora_rank

    def weight(n_in: int, n_out: int) -> tuple:
        w = (torch.randn(n_out, n_in, device=dev, dtype=dt) * n_in**-0.5).requires_grad_(full)
        if full:
            return w, None, None
        a = (torch.randn(lora_rank, n_in, device=dev, dtype=adapter_dtype) * n_in**-0.5).requires_grad_()
        b = torch.zeros(n_out, lora_rank, device=dev, dtype=adapter_dtype, requires_grad=True)
        return w, a, b

    def linear(x: torch.Tensor, wab: tuple) -> torch.Tensor:
        w, a, b = wab
        if a is None:
            return F.linear(x, w)
        if fused_lora:
            return lora_linear(x, w, None, a, b, 2.0)
        y = F.linear(x, w)
        return (y + F.linear(F.linear(x.to(a.dtype), a), b) * 2.0).to(y.dtype)

    wq, wk, wv, wo, wg, wu, wd = (weight(a, b) for a, b in shape.linears)
    norms = [torch.ones(shape.hidden, device=dev, dtype=dt, requires_grad=full) for _ in range(2)]
    x = torch.randn(1, tokens, shape.hidden, device=dev, dtype=dt, requires_grad=True)
    angles = torch.arange(tokens, device=dev, dtype=torch.float32)[:, None] * torch.linspace(
        0, 1, shape.head_dim, device=dev
    )
    cos, sin = angles.cos().to(dt), angles.sin().to(dt)

    def heads(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.view(1, tokens, n, shape.head_dim).transpose(1, 2)

    leaves = [x] + [p for wab in (wq, wk, wv, wo, wg, wu, wd) for p in wab if p is not None and p.requires_grad]
    leaves += [n for n in norms if n.requires_grad]

    rms_norm: Callable = _rms_norm
    silu_mul: Callable = lambda g, u: F.silu(g) * u  # noqa: E731
    if liger_kernels:
        from offloadkit.kernels.liger import liger_ops

        liger_norm, liger_silu_mul = liger_ops()
        rms_norm = lambda t, w: liger_norm.apply(t, w, 1e-6, 0.0, "llama", False)  # noqa: E731
        silu_mul = liger_silu_mul.apply

    def run():
        h = rms_norm(x, norms[0])
        q = _rotate(heads(linear(h, wq), shape.heads), cos, sin)
        k = _rotate(heads(linear(h, wk), shape.kv_heads), cos, sin)
        v = linear(h, wv)
        x1 = x + linear(q.transpose(1, 2).reshape(1, tokens, -1), wo)
        h = rms_norm(x1, norms[1])
        out = x1 + linear(silu_mul(linear(h, wg), linear(h, wu)), wd)
        # Constant gradients stop being constant at the first matmul they meet backward.
        torch.autograd.grad((out, k, v), leaves, (torch.ones_like(out), torch.ones_like(k), torch.ones_like(v)))

    seconds = _median_time(run)
    run = None  # drops the closure's tensors before the cache is emptied
    wq = wk = wv = wo = wg = wu = wd = x = norms = leaves = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return layer_linear_flops(shape, lora_rank, tokens) / seconds


def pcie_rate(nbytes: int) -> float:
    """The slower direction of a pinned host<->device copy of ``nbytes``, bytes/s."""
    from offloadkit.runtime.device import empty_host_cache

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    speeds = []
    for dst, src in ((dev, host), (host, dev)):
        speeds.append(nbytes / _median_time(lambda d=dst, s=src: d.copy_(s, non_blocking=True)))
    del host, dev, dst, src
    # The buffers' memory goes back: a caller (a benchmark's parent process) may live on.
    torch.cuda.empty_cache()
    empty_host_cache()
    return min(speeds)


def disk_rates(nbytes: int, disk_dir: str | None) -> tuple[float, float]:
    """O_DIRECT (when the file system allows it) write and read of ``nbytes``, bytes/s."""
    import mmap

    directory = disk_dir or tempfile.gettempdir()
    path = os.path.join(directory, f"offloadkit-plan-probe-{os.getpid()}")
    buf = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * (nbytes >> 20))
    flags = getattr(os, "O_DIRECT", 0)
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        except OSError:  # tmpfs and some file systems refuse O_DIRECT
            flags = 0
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        os.write(fd, buf)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - t0)
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | flags)
        t0 = time.perf_counter()
        os.readv(fd, [buf])
        read = nbytes / (time.perf_counter() - t0)
        os.close(fd)
    finally:
        buf.close()
        if os.path.exists(path):
            os.unlink(path)
    return write, read
