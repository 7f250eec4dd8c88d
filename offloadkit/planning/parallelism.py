"""One rank of a run over several GPUs: the share of the sequence it holds, what crosses
between ranks, and the host it shares.

Context parallelism (:func:`offloadkit.parallel.apply_context_parallel`) splits every
sequence over ``world_size`` ranks, two of ``2 x world_size`` equal chunks each (chunk ``r``
and its mirror, head-tail), so a rank holds ``seq_len / world_size`` tokens of every row and
runs everything token-wise on them: embeddings, norms, MLPs and their shards, the chunked
loss, checkpointing and its block inputs. The byte model and the FLOP count read
:attr:`Workload.tokens <offloadkit.planning.memory.Workload.tokens>`, which is that share.
Causal attention over the whole sequence splits evenly: each rank's two chunks together
attend to as many keys as any other rank's, so a rank computes ``1/W`` of it.

Ring traffic follows PyTorch's ring attention with its default all-gather rotation (what
``apply_context_parallel`` sets unless told otherwise), per layer and rank:

- forward: the other ranks' keys and values, ``(W-1)/W`` of the sequence's, in one all-gather;
- a checkpointed layer's recompute (and each replayed block): the same once more, unless the
  layer's attention outputs are kept (its recompute then runs no attention);
- backward: the same a third time (the ring backward gathers them again), and the key/value
  gradients around the ring: ``W`` exchanges of the rank's share, accumulated in fp32.

What hides behind attention: the all-gather is waited for once the rank's own block is done
(``1/W`` of its attention in that layer), the rest of it is waited for. Each gradient exchange
hides behind the next block's backward; the last one is waited for. Everything waited for
adds to the step. The all-gather rotation also holds the gathered keys and values of one
layer on the GPU, with the fp32 gradient accumulators (:func:`ring_buffer_bytes`).

Ranks on one host share its RAM and disk: each plans on ``1/ranks_per_host`` of them
(:meth:`Budgets.detect <offloadkit.planning.budgets.Budgets.detect>`).

None of this has been measured on several GPUs yet; the figures follow torch's ring attention
code (2.13) and the constants named here and in :mod:`offloadkit.planning.timing`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offloadkit.planning.memory import Workload

__all__ = [
    "Parallelism",
    "RingTraffic",
    "GRADIENT_BYTES",
    "gather_bytes",
    "gradient_exchange_bytes",
    "kv_sequence_bytes",
    "ring_buffer_bytes",
    "ring_traffic",
    "search_step",
]

# The ring backward accumulates query, key and value gradients in fp32 and sends the key and
# value ones around the ring that way (torch's context-parallel option convert_to_f32, on by
# default).
GRADIENT_BYTES = 4


@dataclass(frozen=True)
class Parallelism:
    """How many ranks the run has, whether they split each sequence, and how many share a host.

    Attributes:
        world_size: ranks of the run (with ``context_parallel``: the ranks one sequence is
            split over).
        context_parallel: each sequence is split over the ranks (``apply_context_parallel``);
            False: each rank trains its own sequences (DDP; FSDP's sharded weights are not
            counted: the plan holds the whole model on each rank).
        ranks_per_host: ranks on one host, sharing its RAM and disk (may exceed
            ``world_size`` where other groups share the host).

    Example:
        >>> Parallelism(world_size=4, context_parallel=True, ranks_per_host=4).sequence_ranks
        4
    """

    world_size: int = 1
    context_parallel: bool = False
    ranks_per_host: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_host"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; pass a number of ranks (an int >= 1)")
        if not isinstance(self.context_parallel, bool):
            raise ValueError(
                f"context_parallel={self.context_parallel!r} is invalid; pass True (one sequence split over "
                "the ranks) or False (each rank its own sequences)"
            )

    @property
    def sequence_ranks(self) -> int:
        """Ranks each sequence is split over (1 without context parallelism)."""
        return self.world_size if self.context_parallel else 1

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
        host = (
            f"host RAM and disk shared by {self.ranks_per_host} ranks"
            if self.ranks_per_host > 1
            else "one rank per host"
        )
        return f"per rank of {self.world_size} ({split}; {host})"


def search_step(parallel: Parallelism, step: int) -> int:
    """Sequence lengths searched in multiples of ``step`` and of the ranks' chunking."""
    return math.lcm(step, parallel.sequence_multiple)


def kv_sequence_bytes(w: Workload) -> int:
    """Keys and values of one layer over the whole sequence (every rank's tokens)."""
    s = w.shape
    return w.batch * w.seq_len * 2 * s.kv_heads * s.head_dim * w.dtype_bytes


def gather_bytes(w: Workload) -> int:
    """Bytes one all-gather of a layer's keys and values brings a rank: the other ranks'
    ``(W-1)/W`` of the sequence's (0 without context parallelism)."""
    ranks = w.parallel.sequence_ranks
    return kv_sequence_bytes(w) * (ranks - 1) // ranks


def gradient_exchange_bytes(w: Workload) -> int:
    """Bytes of one ring step of the key/value gradients: the rank's share, in fp32."""
    if not w.parallel.splits_sequence:
        return 0
    s = w.shape
    return w.tokens * 2 * s.kv_heads * s.head_dim * GRADIENT_BYTES


def ring_buffer_bytes(w: Workload) -> int:
    """GPU bytes the ring backward of one layer holds beside an unsplit attention's: the
    gathered keys and values of the whole sequence and the local copy sent, the fp32 query
    gradient, and the fp32 key/value gradients three times (accumulated, sent, received).
    Counted for all heads: an upper bound where attention runs in key/value head groups."""
    if not w.parallel.splits_sequence:
        return 0
    s = w.shape
    local_kv = w.tokens * 2 * s.kv_heads * s.head_dim
    gathered = kv_sequence_bytes(w) + local_kv * w.dtype_bytes
    gradients = w.tokens * s.heads * s.head_dim * GRADIENT_BYTES + 3 * local_kv * GRADIENT_BYTES
    return gathered + gradients


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


def ring_traffic(w: Workload, reruns: int, layer_attention_s: float, rate: float) -> RingTraffic:
    """The ring's traffic and waits for one step (see the module docstring).

    Args:
        w: the workload.
        reruns: layer forwards whose attention runs again in backward (the recompute, less
            the layers whose attention outputs are kept, and the replayed blocks).
        layer_attention_s: one layer's attention forward on this rank; its backward is twice that.
        rate: the link's bytes/s each way between the ranks.
    """
    ranks = w.parallel.sequence_ranks
    if ranks == 1:
        return RingTraffic()
    layers = w.shape.layers
    gather, exchange = gather_bytes(w), gradient_exchange_bytes(w)
    g, x = gather / rate, exchange / rate
    # Waited for past the rank's own block, 1/W of the layer's attention.
    forward_wait = max(0.0, g - layer_attention_s / ranks)
    block_backward = 2 * layer_attention_s / ranks
    # Again in backward; each gradient exchange hides behind the next block, the last one cannot.
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
