"""``offloadkit train`` under a launcher (``torchrun``, ``accelerate launch``): which
process speaks, and the per-rank figures gathered into one report.

The Trainer sets up the process group itself (from the launcher's environment); this
module only reads the environment and, once training has run, gathers small Python
objects over that group. Rank 0 prints the progress bar and the report, writes the
output directory and saves the model; every rank measures its own peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offloadkit.runtime.ranks import global_rank, local_rank, world_size

__all__ = ["Ranks", "gather", "barrier", "rank_figures", "rank_lines"]

GiB = float(1 << 30)


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run.

    Example:
        >>> Ranks.from_env().main  # outside a launcher
        True
    """

    rank: int = 0
    world: int = 1
    local: int = 0

    @classmethod
    def from_env(cls) -> "Ranks":
        return cls(global_rank(), world_size(), local_rank())

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def device(self, cuda: bool) -> str:
        """The device this rank trains on (one GPU per process, by local rank)."""
        return f"cuda:{self.local}" if cuda else "cpu"


def _group_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def gather(obj) -> list:
    """Every rank's ``obj``, in rank order (``[obj]`` outside a process group)."""
    if not _group_ready() or torch.distributed.get_world_size() == 1:
        return [obj]
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank (rank 0 writes the output while the others wait)."""
    if _group_ready() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def rank_figures(report: dict, ranks: Ranks) -> dict:
    """What each rank reports about itself: its device, peaks and offloaded bytes."""
    keys = ("peak_gpu_bytes", "peak_gpu_reserved_bytes", "peak_rss_bytes")
    return {
        "rank": ranks.rank,
        "local_rank": ranks.local,
        "device": report.get("device"),
        **{k: report.get(k) for k in keys},
        "activations_to_ram_bytes_per_step": report["offloaded"]["activations_to_ram_bytes_per_step"],
        "activations_to_disk_bytes_per_step": report["offloaded"]["activations_to_disk_bytes_per_step"],
    }


def rank_lines(per_rank: list[dict]) -> list[str]:
    """One report line per rank."""
    lines = []
    for r in per_rank:
        gpu = (
            ""
            if r.get("peak_gpu_bytes") is None
            else (
                f"peak GPU {r['peak_gpu_bytes'] / GiB:.3f} GiB "
                f"(reserved {(r['peak_gpu_reserved_bytes'] or 0) / GiB:.3f}), "
            )
        )
        lines.append(
            f"    rank {r['rank']}: {gpu}peak RSS {r['peak_rss_bytes'] / GiB:.3f} GiB, offloaded per step "
            f"{r['activations_to_ram_bytes_per_step'] / GiB:.3f} GiB to RAM, "
            f"{r['activations_to_disk_bytes_per_step'] / GiB:.3f} GiB to disk"
        )
    return lines
