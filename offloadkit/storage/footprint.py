"""What the storage tiers cost in one step, beside their code: where each checkpointed block's
input rests in backward (the GPU, RAM, disk, or nowhere: recomputed), the RAM and disk those
inputs take, the disk tier's staging buffers (``disk.py``'s bytes in flight) and the room the
tiered tier keeps free under its cap (``tiered.py``).

The planner (``planning/memory.py``) sums this with the other components' footprints; the
workload and features are read through the protocols of :mod:`offloadkit.component`.
"""

from __future__ import annotations

from offloadkit.component import Footprint
from offloadkit.component import FootprintFeatures as Features
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.defaults import PREFETCH_FROM_DISK
from offloadkit.storage.disk import MAX_INFLIGHT_BYTES
from offloadkit.storage.tiered import RESERVE_BYTES, RESERVE_CAP_DIVISOR

__all__ = ["block_placement", "disk_staging_bytes", "region_length", "storage_footprint", "tiered_reserve_bytes"]


def block_placement(layers: int, f: Features) -> list[str]:
    """Per decoder layer, where its input lives in backward: ``gpu``, ``ram``, ``disk`` or
    ``recompute`` (kept nowhere: replayed from the kept input before it).

    The last layer's input stays on the GPU (backward needs it first), and so do the newest
    ``gpu_blocks`` before it. Dropped inputs spread evenly over the offloaded ones (block 0's is
    always kept: there is nothing before it to replay from), so each run replays as few blocks
    as possible. The tiered tier keeps the newest entries in RAM and demotes the oldest to disk.
    """
    if not (f.checkpointing and f.offload_inputs):
        return ["gpu"] * layers
    kept = max(0, min(layers - 1, f.gpu_blocks))
    offloaded = layers - 1 - kept
    stored = offloaded - max(0, min(f.recompute_blocks, offloaded - 1))
    heads = {j * offloaded // stored for j in range(stored)} if stored else set()
    in_ram = stored if f.ram_blocks is None else max(0, min(stored, f.ram_blocks))
    tiers = iter(["disk"] * (stored - in_ram) + ["ram"] * in_ram)
    prefix = [next(tiers) if i in heads else "recompute" for i in range(offloaded)]
    return prefix + ["gpu"] * (kept + 1)


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


def disk_staging_bytes(w: Workload, f: Features, placement: list[str]) -> int:
    """Host buffers of the disk tier when block inputs spill: in backward the ones read ahead
    (the horizon) and the one in use (in forward the tiered tier demotes from its own RAM
    blocks; with every input on disk, every write is staged, up to the tier's bytes in
    flight). They are reserved outside the RAM cap, so the host holds the cap plus these."""
    if "disk" not in placement:
        return 0
    horizon = f.horizon if f.horizon is not None else PREFETCH_FROM_DISK
    reads = (horizon + 1) * w.block_input_bytes
    if "ram" in placement:
        return reads
    return max(reads, MAX_INFLIGHT_BYTES, w.block_input_bytes)


def storage_footprint(w: Workload, f: Features) -> Footprint:
    """The block inputs held in RAM and on disk, and the disk tier's staging buffers."""
    placement = block_placement(w.shape.layers, f)
    host = {}
    if "ram" in placement:
        host["block inputs in RAM"] = placement.count("ram") * w.block_input_bytes
    staging = disk_staging_bytes(w, f, placement)
    if staging:
        host["disk staging"] = staging
    return Footprint(host=host, disk=placement.count("disk") * w.block_input_bytes)
