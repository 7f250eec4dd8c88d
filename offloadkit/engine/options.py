"""The activation-offloading engine's options, read from the config keys of the same names."""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.defaults import MAX_FWD_STASH_SIZE, MIN_OFFLOAD_SIZE
from offloadkit.options import Options, option

__all__ = ["ActivationOptions", "ACTIVATION_MODES"]

ACTIVATION_MODES = (False, True, "legacy", "disk")


@dataclass
class ActivationOptions(Options):
    """Where saved activations go and how far ahead they come back.

    Attributes:
        mode: ``activation_offloading``: False, True (pinned RAM, copies overlapped on a side
            stream), "legacy" (synchronous copies) or "disk" (files; RAM up to the host budget
            first with ``disk_tiering``).
        disk_tiering: ``disk_tiering``: with "disk", keep block inputs in RAM up to
            ``host_budget_bytes`` and write the oldest to disk past it.
        loading_horizon: ``activation_loading_horizon``: save groups (layers, with
            checkpointing) brought back ahead; None: 2 from RAM, 4 from disk, and 4 from RAM
            where BackwardAdamW's state travels on the link in backward.
        prefetch_bytes: ``prefetch_bytes``: also keep this many bytes in flight ahead; None:
            1/16 of the step's offloaded bytes that backward fetches ahead (kept attention
            outputs come back with their block's recompute, outside it).
        min_offload_size: ``min_offload_size``: smallest saved tensor moved, in bytes (below
            it a copy's fixed cost is more than the memory it frees).
        max_fwd_stash_size: ``max_fwd_stash_size``: device tensors kept alive while their
            copies to the host are in flight, before forward waits.
        use_pin_memory: ``use_pin_memory``: page-lock host buffers (needed to overlap copies).
    """

    mode: bool | str = option(False, "activation_offloading")
    disk_tiering: bool = option(False, "disk_tiering")
    loading_horizon: int | None = option(None, "activation_loading_horizon")
    prefetch_bytes: int | None = option(None, "prefetch_bytes")
    min_offload_size: int = option(MIN_OFFLOAD_SIZE, "min_offload_size")
    max_fwd_stash_size: int = option(MAX_FWD_STASH_SIZE, "max_fwd_stash_size")
    use_pin_memory: bool = option(True, "use_pin_memory")

    def __post_init__(self) -> None:
        if self.mode not in ACTIVATION_MODES or (self.mode in (0, 1) and not isinstance(self.mode, bool)):
            raise ValueError(
                f"{self.named('mode')}={self.mode!r} is not a mode; use false, true (pinned RAM with streams), "
                "legacy (synchronous) or disk"
            )
        self._bool("disk_tiering")
        self._bool("use_pin_memory")
        self._int("loading_horizon", 0, "0 disables prefetching", optional=True)
        self._int("prefetch_bytes", 0, "bytes kept in flight ahead", optional=True)
        self._int("min_offload_size", 0, "bytes")
        self._int("max_fwd_stash_size", 1, "device tensors kept alive while their copies are in flight")
        if self.disk_tiering and self.mode != "disk":
            raise ValueError(f"{self.said('disk_tiering', True)} needs {self.said('mode', 'disk')} (got {self.mode!r})")

    @property
    def storage(self) -> str:
        """The storage tier the mode asks for: "ram", "disk" or "tiered"."""
        if self.mode == "disk":
            return "tiered" if self.disk_tiering else "disk"
        return "ram"
