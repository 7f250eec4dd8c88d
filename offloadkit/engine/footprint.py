"""What activation offloading costs on the GPU in one step, beside its code: the checkpointed
blocks' inputs held there (those kept, and those the engine brings back ahead in backward: its
prefetch horizon, ``defaults.PREFETCH_FROM_RAM`` or ``PREFETCH_FROM_DISK`` by the tier they
come from). Where the others rest is the storage tiers' footprint (``storage/footprint.py``)."""

from __future__ import annotations

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import Footprint, FootprintOptions
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.defaults import PREFETCH_BESIDE_STATE, PREFETCH_FROM_DISK, PREFETCH_FROM_RAM
from offloadkit.engine.options import ActivationOptions
from offloadkit.optim.options import OptimizerOptions
from offloadkit.storage.footprint import block_placement, offloads_inputs

__all__ = ["activations_footprint", "default_horizon", "prefetch_horizon"]


def default_horizon(from_disk: bool, state_in_backward: bool) -> int:
    """Save groups brought back ahead in backward when ``activation_loading_horizon`` is unset:
    the slowest tier's default, and as far as from disk where optimizer state travels on the
    same link in backward (:func:`offloadkit.prepare` applies it; the planner counts it)."""
    if from_disk:
        return PREFETCH_FROM_DISK
    return PREFETCH_BESIDE_STATE if state_in_backward else PREFETCH_FROM_RAM


def prefetch_horizon(f: FootprintOptions, placement: list[str], state_in_backward: bool = False) -> int:
    """Offloaded block inputs brought back ahead in backward: ``activation_loading_horizon``,
    else the engine's default (:func:`default_horizon`)."""
    asked = f.of(ActivationOptions).loading_horizon
    if asked is not None:
        return asked
    return default_horizon("disk" in placement, state_in_backward)


def activations_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """With checkpointing, the block inputs on the GPU in backward: the kept ones, and with
    them offloaded, the horizon fetched ahead (without checkpointing every saved tensor is the
    model's own, counted by the planner with the layers' saved sets)."""
    if not f.of(CheckpointOptions).enabled:
        return Footprint()
    placement = block_placement(w.shape.layers, f)
    on_gpu = placement.count("gpu")
    if offloads_inputs(f):
        beside_state = f.of(OptimizerOptions).enabled and w.updates_in_backward
        on_gpu += min(prefetch_horizon(f, placement, beside_state), w.shape.layers - 1)
    return Footprint(gpu={"block inputs": on_gpu * w.block_input_bytes})
