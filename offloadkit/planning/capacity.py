"""The longest sequence a plan fits under the budgets, beside the longest the budgets physically
allow (the irreducible bytes of one step): :func:`longest_sequence`, :func:`physical_limit`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from offloadkit.defaults import STREAM_DEPTH
from offloadkit.engine.options import ActivationOptions
from offloadkit.options import Options
from offloadkit.planning.budgets import Budgets
from offloadkit.planning.memory import (
    estimate_memory,
    final_norm_bytes,
)
from offloadkit.planning.parallelism import Parallelism, search_step
from offloadkit.planning.plan import OptimizerSetup, Plan, place_inputs, planned_options, with_options
from offloadkit.planning.planner import SEQ_STEP, _workload, plan

__all__ = ["Capacity", "longest_sequence", "physical_limit"]


@dataclass
class Capacity:
    """The longest sequence the plan fits, beside what the budgets physically allow.

    Attributes:
        longest: longest ``seq_len`` (multiple of :data:`SEQ_STEP`) for which :func:`plan` fits.
        physical: longest for which the irreducible bytes fit (:func:`physical_limit`): one
            layer's recompute and backward with one-token tiles, the resident edge weights and
            two streamed layers on the GPU, and, together with them, every block input and
            streamed weight somewhere on GPU, RAM or disk.
        plan: the plan at ``longest`` (None when even :data:`SEQ_STEP` does not fit).
        limit: what stops ``physical`` ("gpu" or "storage").
        parallel: the ranks planned for; split over them, both lengths are the whole sequence's.
    """

    longest: int
    physical: int
    plan: Plan | None
    limit: str
    parallel: Parallelism = Parallelism()

    @property
    def ratio(self) -> float:
        return self.longest / self.physical if self.physical else 0.0

    def summary(self) -> str:
        ranks = self.parallel.sequence_ranks
        across = f" across {ranks} ranks ({self.longest // ranks} each)" if ranks > 1 else ""
        return (
            f"longest sequence that fits: {self.longest} tokens{across}; physically allowed by the budgets: "
            f"{self.physical} tokens ({self.limit}-limited); reached {self.ratio:.0%}"
        )


def _search(fits, high: int, step: int = SEQ_STEP) -> int:
    lo, hi = 0, max(1, high // step)
    while fits(hi * step) and hi < (1 << 40) // step:  # grow past the guess if it fits
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step


def physical_limit(
    model,
    *,
    batch: int = 1,
    lora_rank: int = 16,
    budgets: Budgets,
    layers: int | None = None,
    dtype_bytes: int = 2,
    optimizer_precision: str = "params",
    optimizer: OptimizerSetup | None = None,
    parallel: Parallelism | None = None,
) -> tuple[int, str]:
    """Longest sequence whose irreducible bytes fit the budgets (see :class:`Capacity`), and
    what limits it.

    Two conditions. The working set of the GPU's largest moment (one layer's recompute and
    backward with one-token tiles, the resident weights, the last block input, nothing
    fetched ahead, no allocator overhead) must fit the GPU alone ("gpu"). And everything
    alive at that moment, the working set plus the other kept block inputs and the streamed
    weights, must fit GPU, RAM and disk together ("storage"): a byte held on the GPU is not
    also free for block inputs. Block inputs may be dropped and recomputed (one kept input
    replays the run after it): each drop frees storage and lengthens a run, whose replayed
    inputs the GPU holds beside the working set; storage is short only when no number of
    drops fits both. Split over ranks (``parallel``), the lengths are the whole sequence's and
    the budgets one rank's, and ring attention rotates all-to-all where the run allows it (the
    lighter rotation).
    """
    parallel = parallel or Parallelism()
    step = search_step(parallel, SEQ_STEP)
    w0 = _workload(model, step, batch, lora_rank, layers, dtype_bytes, optimizer_precision, optimizer, parallel)
    pooled = budgets.gpu_bytes + budgets.host_bytes + budgets.disk_bytes
    # A full fine-tune's AdamW state lives in host RAM where RAM holds it, and the optimizer
    # can be replaced by one that keeps it there.
    state = 0 if lora_rank else -(-w0.shape.params // parallel.weight_shards) * w0.optimizer_state_bytes
    movable = (optimizer or OptimizerSetup()).replaceable
    state_on_host = bool(state) and movable and state <= budgets.host_bytes
    # Streamed weights (frozen, or trainable ones whose state is in host RAM) live in host RAM
    # beside the state; where RAM cannot hold them they stay on the GPU.
    streamed = w0.shape.layers * w0.shape.layer_params * w0.dtype_bytes
    streaming = (bool(lora_rank) or state_on_host) and streamed + (state if state_on_host else 0) <= budgets.host_bytes
    # FSDP2 owns the weights: it streams none and replays no block (both refused under it).
    sharded = parallel.weight_shards > 1
    streaming = streaming and not sharded

    # Ring attention's lighter rotation where the run allows it: one neighbour's keys and values at a time.
    lightest = parallel.rotations[-1]

    def working_set(seq: int, drops: int = 0):
        w = replace(w0, seq_len=seq)
        least = planned_options(
            w,
            offload_inputs=True,
            layer_streaming=streaming,
            loss_chunks=max(1, w.tokens),
            mlp_shards=max(1, w.tokens),
            tiled_projections=True,
            head_groups=w.shape.kv_heads,
            optimizer_offloading=state_on_host,
            rotation=lightest,
        )
        least = with_options(least, ActivationOptions, loading_horizon=0)
        return w, estimate_memory(w, place_inputs(w, least, recompute_blocks=drops)).gpu_peak

    def gpu_ok(seq: int) -> bool:
        return working_set(seq)[1] <= budgets.gpu_bytes

    off_gpu = (streamed if streaming else 0) + (state if state_on_host else 0)

    def storage_ok(seq: int) -> bool:
        # Dropped block inputs take no storage; the runs they lengthen are replayed on the GPU.
        for drops in range(1 if sharded else max(1, w0.shape.layers - 1)):
            w, gpu = working_set(seq, drops)
            if gpu > budgets.gpu_bytes:
                return False
            kept = (w.shape.layers - 1 - drops) * w.block_input_bytes + final_norm_bytes(w, tiled=True)
            if gpu + kept + off_gpu <= pooled:
                return True
        return False

    guess = (1 << 16) * parallel.sequence_ranks
    by_gpu = _search(gpu_ok, guess, step)
    by_storage = _search(storage_ok, guess, step)
    return (by_gpu, "gpu") if by_gpu <= by_storage else (by_storage, "storage")


def longest_sequence(
    model,
    *,
    batch: int = 1,
    lora_rank: int = 16,
    budgets: Budgets | None = None,
    layers: int | None = None,
    dtype_bytes: int = 2,
    stream_depth: int = STREAM_DEPTH,
    optimizer_precision: str = "params",
    optimizer: OptimizerSetup | None = None,
    parallel: Parallelism | None = None,
    fused_lora: bool = False,
    options: tuple[Options, ...] = (),
) -> Capacity:
    """Binary search for the longest sequence :func:`plan` fits under ``budgets`` (split over
    ranks, ``parallel``: the whole sequence, in multiples of ``2 x world_size`` too).

    Example:
        >>> cap = longest_sequence("llama-3-8b", budgets=Budgets(79 << 30, 100 << 30, 60 << 30))
        >>> cap.longest <= cap.physical
        True
    """
    b = budgets if budgets is not None else Budgets.detect(ranks_per_host=parallel.ranks_per_host if parallel else None)
    parallel = parallel or Parallelism()

    common: dict[str, Any] = dict(
        batch=batch,
        lora_rank=lora_rank,
        budgets=b,
        layers=layers,
        dtype_bytes=dtype_bytes,
        optimizer_precision=optimizer_precision,
        optimizer=optimizer,
        parallel=parallel,
    )

    def planned(seq: int) -> Plan:
        return plan(model, seq, stream_depth=stream_depth, fused_lora=fused_lora, options=options, **common)

    step = search_step(parallel, SEQ_STEP)
    longest = _search(lambda seq: planned(seq).fits, (1 << 16) * parallel.sequence_ranks, step)
    physical, limit = physical_limit(model, **common)
    best = planned(longest) if longest else None
    return Capacity(longest, max(physical, longest), best, limit, parallel)
