"""What the planner may use: GPU, host RAM and disk bytes, and the machine's throughputs.

Read from the machine (free GPU memory, the host budget's headroom through
:class:`offloadkit.storage.HostMemoryBudget`, which honours cgroup limits, free space in the
spill directory), each overridable; throughputs default to the constants of
:mod:`offloadkit.planning.timing` and :meth:`Budgets.measure` replaces them with timings of
this machine (a pinned copy each way, an O_DIRECT file write and read, and the model's
causal attention forward and backward through SDPA's default kernel).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch

from offloadkit.planning.timing import Rates

__all__ = ["Budgets", "GPU_CONTEXT_BYTES"]

GiB = 1 << 30
# Device memory the CUDA context and library workspaces (cuBLAS, cuDNN) take outside the
# caching allocator. Assumed (0.5-1 GiB is typical on Hopper).
GPU_CONTEXT_BYTES = 1 << 30
# Disk space left free for everything else on the file system. Assumed.
DISK_MARGIN = 0.05


@dataclass(frozen=True)
class Budgets:
    """Bytes the plan may use on each tier, and the rates to predict time with.

    Attributes:
        gpu_bytes: device memory for the step (allocator reservation at the peak).
        host_bytes: host RAM for offloaded block inputs and streamed weights.
        disk_bytes: disk space for spilled block inputs.
        rates: throughputs.
        source: how each figure was obtained.

    Example:
        >>> Budgets(gpu_bytes=80 << 30, host_bytes=120 << 30, disk_bytes=60 << 30).gpu_bytes >> 30
        80
    """

    gpu_bytes: int
    host_bytes: int
    disk_bytes: int
    rates: Rates = field(default_factory=Rates)
    source: dict = field(default_factory=dict)

    @classmethod
    def detect(
        cls,
        gpu_bytes: int | None = None,
        host_bytes: int | None = None,
        disk_bytes: int | None = None,
        disk_dir: str | None = None,
        device: int | None = None,
    ) -> "Budgets":
        """Read what is not given from this machine.

        Args:
            gpu_bytes: default: the device's total memory minus :data:`GPU_CONTEXT_BYTES`
                (the plan counts the model's weights itself); 80 GiB without CUDA.
            host_bytes: default: the host budget's headroom now (available RAM, cgroup limits
                included, minus the RAM it keeps free).
            disk_bytes: default: free space in ``disk_dir`` (default: the temp dir) less 5%.
        """
        source = {}
        if gpu_bytes is None:
            if torch.cuda.is_available():
                _, total = torch.cuda.mem_get_info(device)
                gpu_bytes, source["gpu"] = int(total) - GPU_CONTEXT_BYTES, f"{torch.cuda.get_device_name(device)} total"
            else:
                gpu_bytes, source["gpu"] = 80 * GiB - GPU_CONTEXT_BYTES, "no CUDA: assumed an 80 GiB GPU"
        else:
            source["gpu"] = "given"
        if host_bytes is None:
            from offloadkit.storage import HostMemoryBudget

            host_bytes, source["host"] = HostMemoryBudget().headroom(), "available RAM minus the kept-free share"
        else:
            source["host"] = "given"
        if disk_bytes is None:
            directory = disk_dir or tempfile.gettempdir()
            disk_bytes = int(shutil.disk_usage(directory).free * (1 - DISK_MARGIN))
            source["disk"] = f"free in {directory} less {DISK_MARGIN:.0%}"
        else:
            source["disk"] = "given"
        return cls(int(gpu_bytes), int(host_bytes), int(disk_bytes), Rates(), source)

    def with_rates(self, rates: Rates) -> "Budgets":
        return dataclasses.replace(self, rates=rates)

    def measure(self, nbytes: int = 256 << 20, disk_dir: str | None = None, shape=None) -> "Budgets":
        """These budgets with the copy and disk rates timed on this machine (GPU figures only
        with CUDA), and with ``shape`` (a :class:`~offloadkit.planning.ModelShape`) its
        attention rate too. Takes a few seconds.

        The attention rate is what bounds a long step: SDPA's default kernel runs 1.5x the
        default constant on an H200 (451-475 TFLOP/s forward and backward from 64K to 512K
        tokens, cuDNN). The matmul rate stays the whole-step figure of
        :mod:`~offloadkit.planning.timing`: one large GEMM runs twice as fast as a step's
        linear work (norms, activations, small adapter matmuls and casts ride on it).

        Returns:
            New budgets; ``rates.source`` says what was measured.
        """
        rates = self.rates
        measured = []
        if torch.cuda.is_available() and shape is not None:
            try:
                rate, backend = _attention_rate(shape)
                rates = dataclasses.replace(rates, attention_flops_per_s=rate)
                measured.append(f"attention ({backend} kernel)")
            except torch.cuda.OutOfMemoryError:  # no fused kernel for these heads: keep the default
                torch.cuda.empty_cache()
        if torch.cuda.is_available():
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            speeds = []
            for dst, src in ((dev, host), (host, dev)):
                times = []
                for _ in range(4):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    dst.copy_(src, non_blocking=True)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                speeds.append(nbytes / statistics.median(times[1:]))
            rates = dataclasses.replace(rates, pcie_bytes_per_s=min(speeds))
            measured.append("pcie")
            del host, dev
        write, read = _disk_rates(nbytes, disk_dir)
        rates = dataclasses.replace(
            rates,
            disk_write_bytes_per_s=write,
            disk_read_bytes_per_s=read,
            source="measured: " + ", ".join(measured + ["disk"]),
        )
        return self.with_rates(rates)


# Tokens of the attention timing: long enough for the kernel's long-context rate (64K is
# within 5% of 512K on an H200), short enough to take a fraction of a second.
ATTENTION_PROBE_TOKENS = 1 << 16


def _attention_rate(shape, tokens: int = ATTENTION_PROBE_TOKENS) -> tuple[float, str]:
    """Causal SDPA forward and backward with the model's heads (key/value heads as they are,
    as transformers calls it without a mask), in executed FLOP/s (2 S^2 heads x head_dim
    forward, twice that backward), and the kernel that ran."""
    import torch.nn.functional as F

    from offloadkit.runtime.attention_ops import sdpa_backend

    gqa = shape.kv_heads != shape.heads

    def tensor(heads: int) -> torch.Tensor:
        size = (1, heads, tokens, shape.head_dim)
        return torch.randn(size, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = tensor(shape.heads), tensor(shape.kv_heads), tensor(shape.kv_heads)
    backend = sdpa_backend(q, k, v, is_causal=True, enable_gqa=gqa)
    grad = torch.ones(1, shape.heads, tokens, shape.head_dim, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        torch.autograd.grad(out, (q, k, v), grad)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del q, k, v, out, grad
    torch.cuda.empty_cache()
    flops = 3 * 2.0 * tokens * tokens * shape.heads * shape.head_dim
    return flops / statistics.median(times[1:]), backend


def _disk_rates(nbytes: int, disk_dir: str | None) -> tuple[float, float]:
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
