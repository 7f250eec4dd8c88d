"""``DTensor`` (FSDP2 shards, context parallelism's sharded attention) seen from offloadkit:
telling one apart, its local tensor, and a new one like it over other local bytes."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DTensorLayout", "is_dtensor", "local_tensor"]


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without distributed support
        return None
    return DTensor


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor``."""
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local tensor (its memory, no copy), else ``t``. A ``DTensor`` is a
    wrapper: its own storage holds no bytes to copy."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


class DTensorLayout:
    """How a ``DTensor`` is spread (mesh, placements, global shape and stride), to wrap other
    local bytes the same way."""

    def __init__(self, t: torch.Tensor) -> None:
        self.mesh = t.device_mesh  # type: ignore[attr-defined]
        self.placements = tuple(t.placements)  # type: ignore[attr-defined]
        self.shape, self.stride = t.shape, t.stride()

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        cls = _dtensor_type()
        assert cls is not None
        return cls.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride)
