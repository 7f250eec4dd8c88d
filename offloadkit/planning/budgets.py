"""What the planner may use: GPU, host RAM and disk bytes, and the machine's throughputs.

Read from the machine (free GPU memory, the host budget's headroom through
:class:`offloadkit.storage.HostMemoryBudget`, which honours cgroup limits, free space in the
spill directory), each overridable; throughputs default to the constants of
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
            try:
                # Over the key/value head groups long plans split attention into.
                rate, backend = timed.attention_rate(shape, groups=shape.kv_heads)
                rates = dataclasses.replace(rates, attention_flops_per_s=rate)
                measured.append(f"attention ({backend} kernel)")
            except torch.cuda.OutOfMemoryError:  # no fused kernel for these heads: keep the default
                pass
            if lora_rank is not None:
                try:
                    rates = dataclasses.replace(rates, matmul_flops_per_s=timed.linear_rate(shape, lora_rank))
                    measured.append("layer linears")
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
