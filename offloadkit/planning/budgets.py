"""What the planner may use: GPU, host RAM and disk bytes, and the machine's throughputs.

Read from the machine (free GPU memory, the host budget's headroom through
:class:`offloadkit.storage.HostMemoryBudget`, which honours cgroup limits, free space in the
spill directory), each overridable; ranks on one host share its RAM and disk, so each gets
its share (the launcher's ``LOCAL_WORLD_SIZE``, or as given). Throughputs default to the constants of
:mod:`offloadkit.planning.timing` and :meth:`Budgets.measure` replaces them with timings of
this machine (:mod:`offloadkit.planning.rates`: a pinned copy each way, an O_DIRECT file
write and read, the model's causal attention and one decoder layer's linear work).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from dataclasses import dataclass, field

import torch

from offloadkit.planning.timing import Rates
from offloadkit.runtime.ranks import local_world_size

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
        host_bytes: host RAM for offloaded block inputs and streamed weights (this rank's:
            :meth:`detect` shares a host's among its ranks).
        disk_bytes: disk space for spilled block inputs (this rank's, as ``host_bytes``).
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
        *,
        ranks_per_host: int | None = None,
        host_bytes_per_rank: int | None = None,
    ) -> "Budgets":
        """Read what is not given from this machine; one rank's share of the host's RAM and disk.

        Args:
            gpu_bytes: default: the device's total memory minus :data:`GPU_CONTEXT_BYTES`
                (the plan counts the model's weights itself); 80 GiB without CUDA.
            host_bytes: the host's, shared by its ranks; default: the host budget's headroom now
                (available RAM, cgroup limits included, minus the RAM it keeps free).
            disk_bytes: the host's, shared by its ranks; default: free space in ``disk_dir``
                (default: the temp dir) less 5%.
            ranks_per_host: ranks sharing this host's RAM and disk (default: the launcher's
                ``LOCAL_WORLD_SIZE``, 1 outside a launcher); each rank's host and disk budgets
                are the host's divided by it, so no rank plans on what the others use.
            host_bytes_per_rank: instead of ``host_bytes``, one rank's own cap (as
                ``host_budget_bytes`` is), used as it is.

        Example:
            >>> Budgets.detect(80 << 30, 400 << 30, 200 << 30, ranks_per_host=4).host_bytes >> 30
            100
        """
        ranks = local_world_size() if ranks_per_host is None else ranks_per_host
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ValueError(
                f"ranks_per_host={ranks_per_host!r} is invalid; pass the ranks sharing this host's RAM and disk "
                "(an int >= 1), or None for the launcher's LOCAL_WORLD_SIZE"
            )
        if host_bytes is not None and host_bytes_per_rank is not None:
            raise ValueError(
                f"host_bytes={host_bytes!r} and host_bytes_per_rank={host_bytes_per_rank!r} are both given; pass "
                "the host's RAM (shared by its ranks) or one rank's cap, not both"
            )
        shared = ""
        if ranks > 1:
            shared = f", divided by {ranks} ranks on this host" + (
                " (LOCAL_WORLD_SIZE)" if ranks_per_host is None else ""
            )
        source = {}
        if gpu_bytes is None:
            if torch.cuda.is_available():
                _, total = torch.cuda.mem_get_info(device)
                gpu_bytes, source["gpu"] = int(total) - GPU_CONTEXT_BYTES, f"{torch.cuda.get_device_name(device)} total"
            else:
                gpu_bytes, source["gpu"] = 80 * GiB - GPU_CONTEXT_BYTES, "no CUDA: assumed an 80 GiB GPU"
        else:
            source["gpu"] = "given"
        if host_bytes_per_rank is not None:
            host_bytes, source["host"] = host_bytes_per_rank, "given for this rank"
        elif host_bytes is None:
            from offloadkit.storage import HostMemoryBudget

            # The budget itself takes one rank's share of the RAM above the kept-free share.
            host_bytes = HostMemoryBudget(ranks_per_node=ranks).headroom()
            source["host"] = "available RAM minus the kept-free share" + shared
        else:
            host_bytes, source["host"] = int(host_bytes) // ranks, "given" + shared
        if disk_bytes is None:
            directory = disk_dir or tempfile.gettempdir()
            disk_bytes = int(shutil.disk_usage(directory).free * (1 - DISK_MARGIN)) // ranks
            source["disk"] = f"free in {directory} less {DISK_MARGIN:.0%}" + shared
        else:
            disk_bytes, source["disk"] = int(disk_bytes) // ranks, "given" + shared
        return cls(int(gpu_bytes), int(host_bytes), int(disk_bytes), Rates(), source)

    def with_rates(self, rates: Rates) -> "Budgets":
        return dataclasses.replace(self, rates=rates)

    def measure(
        self, nbytes: int = 256 << 20, disk_dir: str | None = None, shape=None, lora_rank: int | None = None
    ) -> "Budgets":
        """These budgets with this machine's rates (:mod:`offloadkit.planning.rates`): copies
        and disk always (GPU figures only with CUDA); with ``shape`` (a
        :class:`~offloadkit.planning.ModelShape`) the model's attention rate, and with
        ``lora_rank`` too (0: a full fine-tune) its layer-linear rate. Takes a few seconds.

        Returns:
            New budgets; ``rates.source`` says what was measured.
        """
        from offloadkit.planning import rates as timed

        rates = self.rates
        measured = []
        if torch.cuda.is_available() and shape is not None:
            attention = _fastest_attention(timed, shape)
            if attention is not None:
                rate, kernel, said = attention
                rates = dataclasses.replace(rates, attention_flops_per_s=rate, attention_kernel=kernel)
                measured.append(said)
            if lora_rank is not None:
                try:
                    rates = dataclasses.replace(rates, matmul_flops_per_s=timed.linear_rate(shape, lora_rank))
                    measured.append("layer linears")
                    base = rates.matmul_flops_per_s
                    if lora_rank:
                        base = timed.linear_rate(shape, lora_rank, fused_lora=True)
                        rates = dataclasses.replace(rates, fused_lora_matmul_flops_per_s=base)
                        measured.append("layer linears with fused_lora")
                    from offloadkit.kernels.liger import liger_unusable

                    if liger_unusable() is None:
                        # Over the path offload_plan: auto runs (fused LoRA for a LoRA model).
                        liger = timed.linear_rate(shape, lora_rank, fused_lora=bool(lora_rank), liger_kernels=True)
                        rates = dataclasses.replace(rates, liger_saving_s_per_flop=max(0.0, 1 / base - 1 / liger))
                        measured.append("layer linears with Liger's kernels")
                except torch.cuda.OutOfMemoryError:  # a GPU too full for one layer: keep the default
                    pass
            # Outside the handlers, whose tracebacks hold the probes' tensors.
            torch.cuda.empty_cache()
        if torch.cuda.is_available():
            rates = dataclasses.replace(rates, pcie_bytes_per_s=timed.pcie_rate(nbytes))
            measured.append("pcie")
        write, read = timed.disk_rates(nbytes, disk_dir)
        rates = dataclasses.replace(
            rates,
            disk_write_bytes_per_s=write,
            disk_read_bytes_per_s=read,
            source="measured: " + ", ".join(measured + ["disk"]),
        )
        return self.with_rates(rates)


def _fastest_attention(timed, shape) -> tuple[float, str, str] | None:
    """PyTorch's own attention kernel and each other one this machine runs, timed over the key/value
    head groups long plans split attention into: (the fastest's rate, its ``attention_kernel``
    value, auto where PyTorch's choice was the fastest, what was measured), or None."""
    from offloadkit.kernels.attention import ATTENTION_KERNELS, attention_kernel_unusable

    rates: dict[str, float] = {}
    failed: dict[str, str] = {}
    picked = None
    for kernel in ATTENTION_KERNELS:
        if attention_kernel_unusable(kernel) is not None:
            continue
        try:
            rate, ran = timed.attention_rate(shape, groups=shape.kv_heads, kernel=kernel)
        except torch.cuda.OutOfMemoryError:
            continue
        except Exception as exc:  # no such kernel for these heads here, or a provider that fails
            if kernel == "auto":
                raise
            failed[kernel] = type(exc).__name__
            continue
        if kernel == "auto":
            picked = ran
        rates[kernel] = rate
    if not rates:
        return None
    # PyTorch's choice unless another kernel is measurably (over 2%) faster.
    best = max(rates, key=rates.__getitem__)
    if "auto" in rates and rates[best] <= 1.02 * rates["auto"]:
        best = "auto"
    timed_ones = ", ".join(f"{k if k != 'auto' else f'auto ({picked})'} {r / 1e12:.0f}" for k, r in rates.items())
    failures = "".join(f"; {k} failed ({why})" for k, why in failed.items())
    return rates[best], best, f"attention ({timed_ones} TFLOP/s; fastest: {best}{failures})"
