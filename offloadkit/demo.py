"""A few training steps of a small Llama-style model with and without offloading.

Prints whether the losses are bitwise equal, peak GPU memory (peak RSS on CPU), median
step time and the bytes offloaded. No downloads: the model is built from a config.
"""

from __future__ import annotations

import statistics
import time

import psutil
import torch

from offloadkit.api import get_act_offloading_ctx_manager
from offloadkit.models.zoo import build_llama, make_batch

__all__ = ["run_demo"]


def _train(model, batches, ctx, device):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    proc = psutil.Process()
    rss_peak = proc.memory_info().rss
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for batch in batches:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if ctx is None:
            loss = model(**batch).loss
        else:
            with ctx:
                loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
        rss_peak = max(rss_peak, proc.memory_info().rss)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else rss_peak
    return torch.stack(losses), peak, statistics.median(times[1:] or times)


def run_demo(
    steps: int = 6, shape: str = "small", seq_len: int = 512, batch: int = 2, device: str | None = None
) -> bool:
    """Train twice from the same initial weights; returns True when losses match bitwise."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(
        f"offloadkit demo: Llama '{shape}' ({device}, {str(dtype).replace('torch.', '')}), "
        f"{steps} steps of {batch}x{seq_len} tokens"
    )
    batches = [make_batch(build_vocab(shape), batch, seq_len, device=device, seed=s) for s in range(steps)]

    plain = build_llama(shape, dtype=dtype, device=device, attn_implementation="eager")
    ref_losses, ref_peak, ref_time = _train(plain, batches, None, device)
    del plain

    model = build_llama(shape, dtype=dtype, device=device, attn_implementation="eager")
    # On a CPU-only machine CPU activations are moved to separate host buffers, which
    # shows the mechanism (and its bitwise parity) but saves no memory.
    ctx = get_act_offloading_ctx_manager(model, offload_cpu_tensors=(device == "cpu"))
    losses, peak, step_time = _train(model, batches, ctx, device)
    stats = ctx.collect_stats()

    equal = torch.equal(ref_losses, losses)
    unit = "peak GPU memory" if device == "cuda" else "peak RSS"
    print(f"losses (without)  {[round(x, 4) for x in ref_losses.tolist()]}")
    print(f"losses (with)     {[round(x, 4) for x in losses.tolist()]}")
    print(f"losses bitwise equal: {equal}")
    print(f"{unit}: {ref_peak / 2**20:.1f} MiB without, {peak / 2**20:.1f} MiB with offloading")
    print(f"median step time: {ref_time * 1e3:.1f} ms without, {step_time * 1e3:.1f} ms with")
    print(
        f"offloaded: {stats.offloaded_bytes / 2**20:.1f} MiB in {stats.offloaded_tensors} tensors over {steps} steps "
        f"({stats.deduplicated_tensors} deduplicated); compute waited {stats.wait_seconds:.4f} s"
    )
    ctx.close()
    return equal


def build_vocab(shape: str) -> int:
    from offloadkit.models.zoo import LLAMA_SHAPES

    return LLAMA_SHAPES[shape]["vocab_size"]
