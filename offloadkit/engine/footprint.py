"""What activation offloading costs on the GPU in one step, beside its code: the checkpointed
blocks' inputs held there (those kept, and those the engine brings back ahead in backward: its
prefetch horizon, ``defaults.PREFETCH_FROM_RAM`` or ``PREFETCH_FROM_DISK`` by the tier they
come from). Where the others rest is the storage tiers' footprint (``storage/footprint.py``)."""

from __future__ import annotations

from offloadkit.component import Footprint
from offloadkit.component import FootprintFeatures as Features
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.defaults import PREFETCH_FROM_DISK, PREFETCH_FROM_RAM
from offloadkit.storage.footprint import block_placement

__all__ = ["activations_footprint", "prefetch_horizon"]


def prefetch_horizon(f: Features, placement: list[str]) -> int:
    """Offloaded block inputs brought back ahead in backward: the features' horizon, else the
    engine's default for the slowest tier they rest in."""
    if f.horizon is not None:
        return f.horizon
    return PREFETCH_FROM_DISK if "disk" in placement else PREFETCH_FROM_RAM


def activations_footprint(w: Workload, f: Features) -> Footprint:
    """With checkpointing, the block inputs on the GPU in backward: the kept ones, and with
    them offloaded, the horizon fetched ahead (without checkpointing every saved tensor is the
    model's own, counted by the planner with the layers' saved sets)."""
    if not f.checkpointing:
        return Footprint()
    placement = block_placement(w.shape.layers, f)
    on_gpu = placement.count("gpu")
    if f.offload_inputs:
        on_gpu += min(prefetch_horizon(f, placement), w.shape.layers - 1)
    return Footprint(gpu={"block inputs": on_gpu * w.block_input_bytes})
