"""Where this process sits in a distributed run: read from the launcher's environment
(``torchrun``, ``accelerate launch``, SLURM), never by initialising anything."""

from __future__ import annotations

import os

__all__ = ["global_rank", "local_rank", "local_world_size", "world_size"]


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return default


def local_world_size() -> int:
    """Processes of this run on this node (1 outside a launcher)."""
    return max(1, _env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", default=1))


def local_rank() -> int:
    return _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)


def global_rank() -> int:
    return _env_int("RANK", "SLURM_PROCID", default=0)


def world_size() -> int:
    return max(1, _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1))
