"""One rank of a run over several GPUs: the share of the sequence it holds, what crosses
between ranks, and the host it shares.

Context parallelism (:func:`offloadkit.parallel.apply_context_parallel`) splits every
sequence over ``world_size`` ranks, two of ``2 x world_size`` equal chunks each (chunk ``r``
and its mirror, head-tail), so a rank holds ``seq_len / world_size`` tokens of every row and
runs everything token-wise on them: embeddings, norms, MLPs and their shards, the chunked
loss, checkpointing and its block inputs. The byte model and the FLOP count read
:attr:`Workload.tokens <offloadkit.planning.memory.Workload.tokens>`, which is that share.
Causal attention over the whole sequence splits evenly: each rank's two chunks together
attend to as many keys as any other rank's, so a rank computes ``1/W`` of it, in ``W`` ring
steps of equal work (the first its own keys, causally; each later one half a block).

Ring traffic and buffers follow PyTorch's ring attention (``_templated_ring_attention`` and
its backward, torch 2.13), with either rotation of the keys and values
(``apply_context_parallel(..., rotation=)``, :attr:`Parallelism.rotation`), per layer and rank:

- forward: the other ranks' keys and values, ``(W-1)/W`` of the sequence's: one all-gather
  (``"allgather"``), or ``W-1`` exchanges of one rank's share with the ring's neighbours
  (``"alltoall"``), the same bytes;
- a checkpointed layer's recompute (and each replayed block): the same once more, unless the
  layer's attention outputs are kept (its recompute then runs no attention);
- backward: the same a third time (the ring backward rotates them again, the same way), and
  the key/value gradients around the ring: ``W`` exchanges of the rank's share, in fp32,
  all-to-all whatever the rotation.

What hides behind attention: the all-gather is waited for once the rank's first step is done
(``1/W`` of its attention in that layer). An all-to-all exchange hides behind one step, and in
backward each step's kernel hides the next step's keys and values together with the previous
step's gradients. Each gradient exchange hides behind the next step; the last one is waited
for. Everything waited for adds to the step.

GPU buffers (:func:`ring_buffer_bytes`): the all-gather rotation holds the gathered keys and
values of the whole sequence, all-to-all one neighbour's share at a time; both hold the fp32
gradient accumulators in backward and the fp32 merged output and log-sum-exp in forward.
Where attention runs in key/value head groups (``LongContextOptions.head_groups``) each group is one
ring call: every buffer is one group's.

Ranks on one host share its RAM and disk: each plans on ``1/ranks_per_host`` of them
(:meth:`Budgets.detect <offloadkit.planning.budgets.Budgets.detect>`).

Against runs on 2 and 4 H200s (``benchmarks/results/multi-gpu/``,
``tests/cpu/test_planner_rotation.py``) the predicted peaks are 1.05-1.17x the measured ones,
none below. The link rates are the assumptions named in :mod:`offloadkit.planning.timing`; the
step times over several GPUs have not been checked against runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from offloadkit.parallel.footprint import GRADIENT_BYTES, ring_buffer_bytes, ring_rotation

if TYPE_CHECKING:
    from offloadkit.planning.memory import Workload

__all__ = [
    "Parallelism",
    "RingTraffic",
    "GRADIENT_BYTES",
    "ROTATIONS",
    "gather_bytes",
    "gradient_exchange_bytes",
    "kv_sequence_bytes",
    "ring_buffer_bytes",
    "ring_rotation",
    "ring_traffic",
    "rotation_name",
    "search_step",
]

# The ring's fp32 gradients (GRADIENT_BYTES) and its buffers (ring_buffer_bytes) are context
# parallelism's footprint, beside its code (offloadkit/parallel/footprint.py).
# How ring attention moves keys and values (apply_context_parallel's rotation=), and "auto":
# the planner's choice.
ROTATIONS = ("allgather", "alltoall")


@dataclass(frozen=True)
class Parallelism:
    """How many ranks the run has, whether they split each sequence, and how many share a host.

    Attributes:
        world_size: ranks of the run (with ``context_parallel``: the ranks one sequence is
            split over).
        context_parallel: each sequence is split over the ranks (``apply_context_parallel``);
            False: each rank trains its own sequences (DDP, or FSDP2 with ``shard_weights``).
        shard_weights: FSDP2 (``fully_shard`` on each decoder layer, then the model) shards
            the weights, gradients and optimizer state over the ``world_size`` ranks: a rank
            holds its shards, the root's weights (embeddings, head: gathered from forward to
            backward) and two layers' gathered weights (the one running and the one fetched
            ahead); each step all-gathers the weights twice and reduce-scatters the gradients.
            The plan then streams no weights and drops no block inputs (both refused under
            FSDP2). False: every rank holds the whole model (DDP).
        bucket_view: under DDP, ``gradient_as_bucket_view=True``: the gradients are views of
            DDP's all-reduce buckets. False (DDP's default): the buckets are a second copy of
            every trainable gradient, held for the model's life.
        ranks_per_host: ranks on one host, sharing its RAM and disk (may exceed
            ``world_size`` where other groups share the host).
        rotation: how ring attention moves keys and values between the ranks of a sequence:
            ``"allgather"`` (one all-gather a layer: fewer, larger transfers; the whole
            sequence's keys and values on each GPU), ``"alltoall"`` (one exchange a ring step:
            one rank's share at a time), or ``"auto"``: the planner takes all-gather where it
            fits, else all-to-all (:attr:`Plan.rotation <offloadkit.planning.plan.Plan.rotation>`).

    Example:
        >>> Parallelism(world_size=4, context_parallel=True, ranks_per_host=4).sequence_ranks
        4
    """

    world_size: int = 1
    context_parallel: bool = False
    ranks_per_host: int = 1
    rotation: str = "auto"
    shard_weights: bool = False
    bucket_view: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_host"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; pass a number of ranks (an int >= 1)")
        if not isinstance(self.shard_weights, bool):
            raise ValueError(
                f"shard_weights={self.shard_weights!r} is invalid; pass True (FSDP2 shards the weights over the "
                "ranks) or False (each rank holds the whole model)"
            )
        if not isinstance(self.context_parallel, bool):
            raise ValueError(
                f"context_parallel={self.context_parallel!r} is invalid; pass True (one sequence split over "
                "the ranks) or False (each rank its own sequences)"
            )
        if self.rotation not in (*ROTATIONS, "auto"):
            raise ValueError(
                f"rotation={self.rotation!r} is invalid; pass 'allgather' (one all-gather a layer), 'alltoall' "
                "(one exchange a ring step: less GPU memory) or 'auto' (the planner picks: all-gather where it fits)"
            )

    @property
    def rotations(self) -> tuple[str, ...]:
        """The rotations a plan may use, preferred first."""
        return ROTATIONS if self.rotation == "auto" else (self.rotation,)

    @property
    def sequence_ranks(self) -> int:
        """Ranks each sequence is split over (1 without context parallelism)."""
        return self.world_size if self.context_parallel else 1

    @property
    def ddp(self) -> bool:
        """Whether each rank holds the whole model and DDP all-reduces its gradients."""
        return self.world_size > 1 and not self.context_parallel and not self.shard_weights

    @property
    def weight_shards(self) -> int:
        """Ranks the weights, gradients and optimizer state are sharded over (1: none)."""
        return self.world_size if self.shard_weights else 1

    @property
    def splits_sequence(self) -> bool:
        return self.sequence_ranks > 1

    @property
    def one_host(self) -> bool:
        """Whether the ranks of one sequence share a host (and its GPU links)."""
        return self.sequence_ranks <= self.ranks_per_host

    @property
    def sequence_multiple(self) -> int:
        """What a sequence length must be a multiple of: ``2 x world_size`` head-tail chunks."""
        return 2 * self.sequence_ranks if self.splits_sequence else 1

    def check_seq_len(self, seq_len: int) -> None:
        """Raise where ``seq_len`` cannot be split into the ranks' head-tail chunks."""
        m = self.sequence_multiple
        if seq_len % m:
            raise ValueError(
                f"seq_len={seq_len!r} cannot be split over {self.world_size} ranks; context parallelism needs a "
                f"multiple of 2 x world_size = {m}: pad to {-(-seq_len // m) * m} (labels -100)"
            )

    def describe(self, seq_len: int) -> str:
        """``per rank of 4 (context parallel: 262144 of the 1048576 tokens each; ...)``."""
        if self.splits_sequence:
            split = f"context parallel: {seq_len // self.world_size} of the {seq_len} tokens each"
        else:
            split = "each with its own sequences"
        if self.weight_shards > 1:
            split += f", weights sharded over {self.weight_shards} (FSDP2)"
        host = (
            f"host RAM and disk shared by {self.ranks_per_host} ranks"
            if self.ranks_per_host > 1
            else "one rank per host"
        )
        return f"per rank of {self.world_size} ({split}; {host})"


def search_step(parallel: Parallelism, step: int) -> int:
    """Sequence lengths searched in multiples of ``step`` and of the ranks' chunking."""
    return math.lcm(step, parallel.sequence_multiple)


def rotation_name(rotation: str) -> str:
    """``all-gather`` or ``all-to-all``."""
    return {"allgather": "all-gather", "alltoall": "all-to-all"}.get(rotation, rotation)


def kv_sequence_bytes(w: Workload) -> int:
    """Keys and values of one layer over the whole sequence (every rank's tokens)."""
    s = w.shape
    return w.batch * w.seq_len * 2 * s.kv_heads * s.head_dim * w.dtype_bytes


def gather_bytes(w: Workload) -> int:
    """Bytes of the other ranks' keys and values that reach a rank in one rotation of a layer:
    ``(W-1)/W`` of the sequence's (0 without context parallelism), in one all-gather or in
    ``W-1`` all-to-all exchanges of one rank's share."""
    ranks = w.parallel.sequence_ranks
    return kv_sequence_bytes(w) * (ranks - 1) // ranks


def gradient_exchange_bytes(w: Workload) -> int:
    """Bytes of one ring step of the key/value gradients: the rank's share, in fp32."""
    if not w.parallel.splits_sequence:
        return 0
    s = w.shape
    return w.tokens * 2 * s.kv_heads * s.head_dim * GRADIENT_BYTES


@dataclass(frozen=True)
class RingTraffic:
    """A rank's ring traffic over one step, and what of it the step waits for.

    Attributes:
        forward_bytes / backward_bytes: bytes received in each pass (the recompute in backward).
        seconds: the link's time for all of it.
        forward_wait_s / backward_wait_s: the part not hidden behind attention, in each pass.
    """

    forward_bytes: int = 0
    backward_bytes: int = 0
    seconds: float = 0.0
    forward_wait_s: float = 0.0
    backward_wait_s: float = 0.0

    @property
    def wait_s(self) -> float:
        return self.forward_wait_s + self.backward_wait_s


def ring_traffic(
    w: Workload, reruns: int, layer_attention_s: float, rate: float, rotation: str = "allgather"
) -> RingTraffic:
    """The ring's traffic and waits for one step (see the module docstring).

    Args:
        w: the workload.
        reruns: layer forwards whose attention runs again in backward (the recompute, less
            the layers whose attention outputs are kept, and the replayed blocks).
        layer_attention_s: one layer's attention forward on this rank; its backward is twice that.
        rate: the link's bytes/s each way between the ranks.
        rotation: ``"allgather"`` or ``"alltoall"``: the same bytes, waited for differently.
    """
    ranks = w.parallel.sequence_ranks
    if ranks == 1:
        return RingTraffic()
    layers = w.shape.layers
    gather, exchange = gather_bytes(w), gradient_exchange_bytes(w)
    g, x = gather / rate, exchange / rate
    # One ring step's attention: 1/W of the layer's on this rank, twice that in backward.
    block, block_backward = layer_attention_s / ranks, 2 * layer_attention_s / ranks
    if rotation == "alltoall":
        # W-1 exchanges of one rank's share, each behind one step. In backward the first step
        # hides the next keys and values, the middle ones those and the previous step's
        # gradients, the last step the gradients alone; the last gradients are waited for.
        share = g / (ranks - 1)
        forward_wait = (ranks - 1) * max(0.0, share - block)
        backward_wait = (
            max(0.0, share - block_backward)
            + (ranks - 2) * max(0.0, share + x - block_backward)
            + max(0.0, x - block_backward)
            + x
        )
    else:
        # Waited for past the rank's first step; again in backward, where each gradient
        # exchange hides behind the next step and the last one cannot.
        forward_wait = max(0.0, g - block)
        backward_wait = max(0.0, g - block_backward) + (ranks - 1) * max(0.0, x - block_backward) + x
    forward_bytes = layers * gather
    backward_bytes = reruns * gather + layers * (gather + ranks * exchange)
    return RingTraffic(
        forward_bytes=forward_bytes,
        backward_bytes=backward_bytes,
        seconds=(forward_bytes + backward_bytes) / rate,
        forward_wait_s=layers * forward_wait,
        backward_wait_s=reruns * forward_wait + layers * backward_wait,
    )
