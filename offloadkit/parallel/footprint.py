"""What context parallelism costs on the GPU in one step, beside its code: the buffers ring
attention holds beside an unsplit attention's while a layer's attention runs (torch's
``_templated_ring_attention`` and its backward, with either rotation of the keys and values).
The traffic and its overlap are the planner's (``planning/parallelism.py``)."""

from __future__ import annotations

from offloadkit.component import Footprint, FootprintOptions
from offloadkit.component import FootprintParallelism as Parallelism
from offloadkit.component import FootprintWorkload as Workload
from offloadkit.longctx.attention_groups import kv_head_groups
from offloadkit.longctx.options import LongContextOptions
from offloadkit.parallel.options import ParallelOptions

__all__ = [
    "GATHERED_LAYERS",
    "GRADIENT_BYTES",
    "chosen_rotation",
    "context_parallel_footprint",
    "ring_buffer_bytes",
    "ring_rotation",
    "sharded_weights_footprint",
]

# Decoder layers whose weights FSDP2 holds gathered at once: the one running and the one its
# prefetch brings ahead (forward and backward prefetch one unit by default).
GATHERED_LAYERS = 2

# The ring backward accumulates query, key and value gradients in fp32 and sends the key and
# value ones around the ring that way (torch's context-parallel option convert_to_f32, on by
# default); its forward merges the steps' outputs and log-sum-exps in fp32 as well.
GRADIENT_BYTES = 4


# Keys and values (in units of one group's local share) a ring call holds while a step's
# kernel runs, at its first step, a middle one and its last, from torch's code: all-gather,
# the local contiguous copy, the copy made to send (one a step, kept until the next) and the
# gathered ``W``; all-to-all, the block in use, the copy sent and the one being received.
def _kv_held(rotation: str, ranks: int) -> tuple[int, int, int]:
    if rotation == "alltoall":
        return 3, 3, 2
    return ranks + 2, ranks + 1, ranks + 1


def ring_buffer_bytes(w: Workload, groups: int = 1, rotation: str = "allgather") -> int:
    """GPU bytes one layer's ring attention holds beside an unsplit attention's, at the larger
    of its backward and its forward (the recompute), for one ring call: one key/value head
    group's when attention runs in ``groups`` groups (each is its own ring call, in turn).

    Backward, while a step's kernel runs (the kernel's workspace and outputs are an unsplit
    attention's): the fp32 query-gradient accumulator; the fp32 key/value gradients, at the
    first step the accumulator alone, at each later one the accumulator, the copy sent and the
    one received; the keys and values :func:`_kv_held` counts for the rotation. Forward: the
    merger's fp32 output and log-sum-exp (16-bit activations: the steps' outputs are merged in
    fp32) and the keys and values of the first step. The larger is the backward's.
    """
    if not w.parallel.splits_sequence:
        return 0
    s, t, ranks = w.shape, w.tokens, w.parallel.sequence_ranks
    g = max(1, groups)
    q = t * s.heads * s.head_dim // g  # one group's queries, elements
    kv = t * 2 * s.kv_heads * s.head_dim // g  # its keys and values
    b, f = w.dtype_bytes, GRADIENT_BYTES
    first, middle, last = _kv_held(rotation, ranks)
    steps = [first * kv * b + kv * f, last * kv * b + 3 * kv * f]
    if ranks > 2:
        steps.append(middle * kv * b + 3 * kv * f)
    backward = q * f + max(steps)
    merger = q * f + t * s.heads // g * 4 if b < GRADIENT_BYTES else 0
    forward = merger + first * kv * b
    return max(backward, forward)


def ring_rotation(parallel: Parallelism, chosen: str | None = None) -> str:
    """The rotation a plan's ring attention uses: ``chosen`` (the plan's), else the run's own,
    all-gather where that is ``"auto"`` (torch's default)."""
    if chosen is not None:
        return chosen
    return parallel.rotation if parallel.rotation != "auto" else "allgather"


def chosen_rotation(f: FootprintOptions) -> str | None:
    """The rotation ``context_parallel_rotation`` fixes; None where it is "auto"."""
    rotation = f.of(ParallelOptions).rotation
    return None if rotation == "auto" else rotation


def context_parallel_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """One ring call's buffers (one head group's), held while a layer's attention runs
    backward: what they raise the layer's backward by is the part ``ring attention buffers``."""
    groups = kv_head_groups(f.of(LongContextOptions).head_groups or 1, w.shape.kv_heads)
    ring = ring_buffer_bytes(w, groups, ring_rotation(w.parallel, chosen_rotation(f)))
    return Footprint(attention_backward=ring, backward_part="ring attention buffers" if ring else "")


def sharded_weights_footprint(w: Workload, f: FootprintOptions) -> Footprint:
    """FSDP2's weights on one rank (``parallel.shard_weights``): its shard of the decoder
    layers', the root's whole (embeddings, final norm, head: gathered from forward to backward)
    and :data:`GATHERED_LAYERS` layers gathered. Replaces the model's whole weights."""
    shards = w.parallel.weight_shards
    if shards <= 1:
        return Footprint()
    s, b = w.shape, w.dtype_bytes
    root = s.embed_params + s.head_params + s.hidden
    layers = s.layers * s.layer_params
    gathered = min(GATHERED_LAYERS, s.layers) * s.layer_params
    return Footprint(gpu={"weights": (-(-layers // shards) + root + gathered) * b})
