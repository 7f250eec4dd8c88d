"""What the storage tiers cost in one step, beside their code: where each checkpointed block's
input rests in backward (the GPU, RAM, disk, or nowhere: recomputed), the RAM and disk those
inputs take, the disk tier's staging buffers (``disk.py``'s bytes in flight) and the room the
tiered tier keeps free under its cap (``tiered.py``).

The planner (``planning/memory.py``) sums this with the other components' footprints; the
workload and the components' options are read through the protocols of
:mod:`offloadkit.component`. Where block inputs wait is checkpointing's options'
(``block_input_placement``, else ``gpu_block_inputs`` and ``recompute_block_inputs``), and
the tier the engine's (``activation_offloading``).
"""

from __future__ import annotations

from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import Footprint, FootprintOptions
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.defaults import PREFETCH_FROM_DISK
from offloadkit.engine.options import ActivationOptions
from offloadkit.storage.disk import MAX_INFLIGHT_BYTES
from offloadkit.storage.tiered import RESERVE_BYTES, RESERVE_CAP_DIVISOR

__all__ = [
    "block_placement",
    "disk_staging_bytes",
    "offloads_inputs",
    "region_length",
    "storage_footprint",
    "tiered_reserve_bytes",
]


def offloads_inputs(f: FootprintOptions) -> bool:
    """Whether checkpointed blocks' inputs are offloaded (checkpointing on, offloading on)."""
    return f.of(CheckpointOptions).enabled and f.of(ActivationOptions).mode is not False


def block_placement(layers: int, f: FootprintOptions) -> list[str]:
    """Per decoder layer, where its input lives in backward: ``gpu``, ``ram``, ``disk`` or
    ``recompute`` (kept nowhere: replayed from the kept input before it), as the options set
    it: ``block_input_placement`` where given (what a plan chose), else the last layer's input
    and the newest ``gpu_block_inputs`` before it on the GPU, the layers of
    ``recompute_block_inputs`` kept nowhere and the rest in the engine's tier (on disk with
    ``activation_offloading: disk`` without tiering, else in RAM). Without offloading, every
    input stays on the GPU.
    """
    if not offloads_inputs(f):
        return ["gpu"] * layers
    ckpt = f.of(CheckpointOptions)
    if ckpt.block_input_placement:
        return list(ckpt.block_input_placement)
    kept = max(0, min(layers - 1, ckpt.gpu_block_inputs))
    offloaded = layers - 1 - kept
    tier = "disk" if f.of(ActivationOptions).storage == "disk" else "ram"
    dropped = set(ckpt.recompute_block_inputs)
    return ["recompute" if i in dropped else tier for i in range(offloaded)] + ["gpu"] * (kept + 1)


def region_length(placement: list[str]) -> int:
    """Blocks in the longest run that one kept input replays (1: nothing is dropped)."""
    longest = run = 1
    for where in placement[1:]:
        run = run + 1 if where == "recompute" else 1
        longest = max(longest, run)
    return longest


def tiered_reserve_bytes(base: int) -> int:
    """The free room the tiered tier keeps under a cap of ``base`` plus this room
    (``min(RESERVE_BYTES, cap // RESERVE_CAP_DIVISOR)``, demoting the oldest entries to disk
    ahead of need). With ``cap = base + room`` and the room a ``1/D`` share of the cap, the
    room is ``base // (D - 1)``."""
    return min(RESERVE_BYTES, base // (RESERVE_CAP_DIVISOR - 1))


def disk_staging_bytes(w: Workload, f: FootprintOptions, placement: list[str]) -> int:
    """Host buffers of the disk tier when block inputs spill: in backward the ones read ahead
    (the horizon) and the one in use (in forward the tiered tier demotes from its own RAM
    blocks; with every input on disk, every write is staged, up to the tier's bytes in
    flight). They are reserved outside the RAM cap, so the host holds the cap plus these."""
    if "disk" not in placement:
        return 0
    asked = f.of(ActivationOptions).loading_horizon
    horizon = asked if asked is not None else PREFETCH_FROM_DISK
    reads = (horizon + 1) * w.block_input_bytes
    if "ram" in placement:
        return reads
    return max(reads, MAX_INFLIGHT_BYTES, w.block_input_bytes)


def storage_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """The block inputs held in RAM and on disk, and the disk tier's staging buffers."""
    placement = block_placement(w.shape.layers, f)
    host = {}
    if "ram" in placement:
        host["block inputs in RAM"] = placement.count("ram") * w.block_input_bytes
    staging = disk_staging_bytes(w, f, placement)
    if staging:
        host["disk staging"] = staging
    return Footprint(host=host, disk=placement.count("disk") * w.block_input_bytes)
