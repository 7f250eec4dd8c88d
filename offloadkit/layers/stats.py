"""What layer streaming did: loads, prefetches, misses, write-backs, residency, waits."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["StreamStats"]


@dataclass
class StreamStats:
    loads: int = 0
    loaded_bytes: int = 0
    prefetched: int = 0
    misses: int = 0  # a block was needed and its load had not been issued
    write_backs: int = 0  # evictions that copied updated weights back to the host
    replay_loads: int = 0  # loads for a replayed run of blocks (dropped inputs recomputed)
    max_resident: int = 0
    wait_seconds: float = 0.0
    disk_layers: int = 0  # blocks whose host copy is a file (past the RAM budget)
    disk_bytes: int = 0
    disk_read_bytes: int = 0
    skipped_params: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        files = f"; {self.disk_layers} layers in files ({self.disk_read_bytes / 2**30:.2f} GiB read)"
        return (
            f"layer streaming: {self.loads} loads ({self.loaded_bytes / 2**30:.2f} GiB), "
            f"{self.misses} misses, {self.write_backs} write-backs, at most {self.max_resident} layers resident, "
            f"compute waited {self.wait_seconds:.4f} s" + (files if self.disk_layers else "")
        )
