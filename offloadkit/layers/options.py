"""Layer streaming's options, read from the config keys of the same names."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.defaults import STREAM_DEPTH
from offloadkit.options import Options, option

__all__ = ["StreamingOptions"]


@dataclass
class StreamingOptions(Options):
    """Which decoder-layer weights visit the GPU one layer at a time, and from where.

    Attributes:
        enabled: ``layer_offloading``: stream the frozen weights (and a full fine-tune's
            trainable ones when the optimizer updates them in backward) from pinned host memory.
        depth: ``layer_offloading_depth``: layers resident at once (2: one computing, one
            arriving).
        disk_dir: ``layer_offloading_dir``: past the host budget, layers' weights wait in files
            in a private directory made here (read back through pinned staging; trainable ones
            need updates in backward); None: the budget must hold every streamed layer.
    """

    enabled: bool = option(False, "layer_offloading")
    depth: int = option(STREAM_DEPTH, "layer_offloading_depth")
    disk_dir: str | None = option(None, "layer_offloading_dir")

    def __post_init__(self) -> None:
        self._bool("enabled")
        self._int("depth", 1, "the number of resident layers")
        self._path("disk_dir")
