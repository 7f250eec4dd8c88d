"""Step time of one training step from FLOPs and bytes moved, and what bounds it.

FLOPs counted (per token, P = a decoder layer's linear weights x layers):
- linears: forward 2P; backward 4P for a full fine-tune (input and weight gradients), 2P
  for LoRA (input gradients only; the adapters' own FLOPs are added); recompute 2P under
  checkpointing, plus the attention projections' forward once more when tiled (a tiled MLP's
  forward in its own backward replaces its recompute, which the layer's recompute skips);
- the head: forward and input gradient 2VH each (and 2VH for its weight in a full fine-tune);
- causal attention: 2 S^2 (heads x head_dim) per layer and row forward (half of the
  full square's 4 S^2 d), backward twice that, recompute once more: 8 S^2 d per layer;
- each dropped block input (recompute placement): one more forward of the block before it;
- with selective checkpointing, no forward in the recompute of the ops whose outputs it saves
  (every linear, the attention kernel);
- with the attention outputs kept (``keep_attention``), no attention forward in the recompute;
  their copies cross the link each way, and the way back is waited for as each layer's
  recompute starts.

Executed work is counted (the recompute included): achieved TFLOP/s reported by the
capacity benchmark is hardware FLOPs, not "model FLOPs".

Copies overlap compute on side streams: forward takes max(compute, device->host copies,
disk writes) and backward max(compute, host->device copies, disk reads). With the optimizer
state in host memory (a full fine-tune's BackwardAdamW), all of it crosses the link to the
GPU and back during backward, each direction on its own stream; with the updates deferred to
``step()`` (clipping, fp16 loss scaling) it crosses after backward, exposed, together with
any streamed trainable weights, which the deferred updates read and write in host memory. With a prefetch
horizon of 0 nothing is fetched ahead, so every block input's fetch adds to backward.

With a sequence split over several ranks (:mod:`offloadkit.planning.parallelism`) a rank
counts its share of the tokens and ``1/W`` of the causal attention; ring attention's traffic
takes the link between the ranks, and what attention does not hide adds to each pass (the same
bytes with either rotation, waited for differently: :func:`~offloadkit.planning.parallelism.ring_traffic`).
"""

from __future__ import annotations

from dataclasses import dataclass

from offloadkit.checkpointing.footprint import selective_recompute_skips
from offloadkit.checkpointing.options import CheckpointOptions
from offloadkit.component import FootprintOptions
from offloadkit.engine.options import ActivationOptions
from offloadkit.kernels.options import KernelOptions
from offloadkit.layers.options import StreamingOptions
from offloadkit.longctx.footprint import tiled_mlp_footprint, tiled_mlp_shards
from offloadkit.lora.options import LoraOptions
from offloadkit.optim.options import OptimizerOptions
from offloadkit.parallel.footprint import chosen_rotation
from offloadkit.planning.memory import (
    StepOptions,
    Workload,
    attention_kept_bytes,
    block_placement,
    keeps_attention,
    step_options,
    streams_weights,
)
from offloadkit.planning.parallelism import ring_rotation, ring_traffic
from offloadkit.storage.footprint import offloads_inputs

__all__ = [
    "Rates",
    "StepTime",
    "step_flops",
    "estimate_time",
    "MATMUL_FLOPS_PER_S",
    "ATTENTION_FLOPS_PER_S",
    "PCIE_BYTES_PER_S",
    "DISK_WRITE_BYTES_PER_S",
    "DISK_READ_BYTES_PER_S",
    "LINK_BYTES_PER_S",
    "LIGER_LINEAR_SPEEDUP",
    "NETWORK_BYTES_PER_S",
]

# bf16 FLOP rates of a whole Llama step, not of one large matmul. Derived: the 8B LoRA
# r=16 16K checkpointing step on H200 (2.984 s, benchmarks/results/engine/
# llama-3-8b-lora-16k-h200.md) is 1.007e15 FLOPs by this module's count, 3.37e14 FLOP/s;
# the H100 SXM has the same dense bf16 peak. Attention's rate is assumed a little lower
# (causal flash/efficient SDPA kernels, backward included).
MATMUL_FLOPS_PER_S = 3.37e14
ATTENTION_FLOPS_PER_S = 3.0e14
# The same work outside attention runs this much faster with fused_lora (the adapters in the
# compute dtype, offloadkit/lora): the compute stream's gemm and elementwise time of the 8B
# LoRA r=16 step went 0.941 -> 0.725 s at 64K (1.298x) and 3.793 -> 2.913 s at 256K (1.302x)
# on an H100 (benchmarks/results/fused-lora/h100-caa6bbc/).
FUSED_LORA_LINEAR_SPEEDUP = 1.30
# And this much faster again with Liger's norm and gated-MLP kernels (offloadkit/kernels): the
# compute stream's gemm and pointwise time of that step with fused_lora went 0.685 -> 0.628 s
# at 64K and 2.782 -> 2.561 s at 256K on an H200 (1.09x, 1.086x;
# benchmarks/results/liger/h200x2-acd2e36/). Counted as the seconds it saves per FLOP of that
# path, on any path (the pointwise work it replaces does not grow with the matmuls); one of
# the two kernels is assumed half of it.
LIGER_LINEAR_SPEEDUP = 1.09
# Pinned host<->device copies: 55.5 GB/s measured on the H200 (PCIe Gen5) in
# benchmarks/results/README.md; a shared link is assumed to give each direction that much.
PCIE_BYTES_PER_S = 55.5e9
# O_DIRECT sequential file I/O: 2.4 GB/s write and 2.7 GB/s read measured with dd on the
# lent GPU machine (benchmarks/results/disk/disk-raw-dd-h200.txt); writes are assumed to
# reach 1.3 GB/s under concurrent reads (the lower end reported for that disk).
DISK_WRITE_BYTES_PER_S = 1.3e9
DISK_READ_BYTES_PER_S = 2.7e9
# Ring attention's traffic between the GPUs of one host, each way. Assumed, not measured:
# NVLink 4 on an H100 SXM carries 450 GB/s each way, collectives reach less of it, and the
# link also carries the data-parallel gradients; a third is assumed. GPUs without NVLink
# exchange over PCIe, far slower (override with the rate of those links).
LINK_BYTES_PER_S = 150e9
# Between hosts: one 400 Gb/s InfiniBand port per GPU (50 GB/s), 80% of it reached. Assumed.
NETWORK_BYTES_PER_S = 40e9


@dataclass(frozen=True)
class Rates:
    """Throughputs the step-time model uses (override any with measured ones).

    Example:
        >>> Rates(matmul_flops_per_s=4e14).pcie_bytes_per_s
        55500000000.0
    """

    matmul_flops_per_s: float = MATMUL_FLOPS_PER_S
    attention_flops_per_s: float = ATTENTION_FLOPS_PER_S
    pcie_bytes_per_s: float = PCIE_BYTES_PER_S
    disk_write_bytes_per_s: float = DISK_WRITE_BYTES_PER_S
    disk_read_bytes_per_s: float = DISK_READ_BYTES_PER_S
    source: str = "defaults"
    link_bytes_per_s: float = LINK_BYTES_PER_S
    network_bytes_per_s: float = NETWORK_BYTES_PER_S
    fused_lora_matmul_flops_per_s: float | None = None
    liger_saving_s_per_flop: float | None = None
    # The attention kernel attention_flops_per_s was measured with: the fastest here ("auto":
    # PyTorch's own choice was, or nothing else was measured).
    attention_kernel: str = "auto"

    def linear_flops_per_s(self, fused_lora: bool = False, liger_kernels: int = 0) -> float:
        """The rate of the work outside attention: with ``fused_lora``, the measured fused rate,
        else :data:`FUSED_LORA_LINEAR_SPEEDUP` times the PEFT path's; with Liger's kernels
        (``liger_kernels``: how many of the two, norms and gated MLP), less the seconds per
        FLOP they save (:attr:`liger_saving_s_per_flop`, measured; else from
        :data:`LIGER_LINEAR_SPEEDUP` over the fused path; half of it for one kernel)."""
        fused = self.fused_lora_matmul_flops_per_s or self.matmul_flops_per_s * FUSED_LORA_LINEAR_SPEEDUP
        rate = fused if fused_lora else self.matmul_flops_per_s
        if not liger_kernels:
            return rate
        saving = self.liger_saving_s_per_flop
        if saving is None:
            saving = (1 - 1 / LIGER_LINEAR_SPEEDUP) / fused
        return 1 / (1 / rate - saving * min(liger_kernels, 2) / 2)


@dataclass
class StepTime:
    """Predicted step time and its parts (seconds), and the bound of each phase.

    Attributes:
        seconds: predicted step time.
        compute_s / pcie_s / disk_s: time each resource needs over the whole step.
        bound: what sets the step time ("compute", "pcie", "disk", or "ring": waits on the
            other ranks' keys and values, past the attention that hides them).
        linear_flops / attention_flops: executed FLOPs.
        ring_s / ring_wait_s: the link's time for ring attention's traffic, and the part of
            it the step waits for (both 0 without a sequence split over ranks).
        shard_s: the link's time for FSDP2's all-gathers and reduce-scatters (0 unsharded);
            "shards"-bound where it is longer than the compute it overlaps.
    """

    seconds: float
    compute_s: float
    pcie_s: float
    disk_s: float
    bound: str
    linear_flops: float
    attention_flops: float
    ring_s: float = 0.0
    ring_wait_s: float = 0.0
    shard_s: float = 0.0

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops


def _replays(w: Workload, o: FootprintOptions) -> int:
    """Blocks run forward once more in backward to rebuild dropped block inputs (as many as
    the placement drops)."""
    return block_placement(w.shape.layers, o).count("recompute")


def step_flops(w: Workload, f: StepOptions) -> tuple[float, float, float, float]:
    """(forward linear, backward linear, forward attention, backward attention) FLOPs, where
    backward includes the recompute."""
    w, o = step_options(w, f)
    checkpointing = o.of(CheckpointOptions).enabled
    s, t = w.shape, w.tokens
    layer_linear = sum(a * b for a, b in s.linears)
    p = layer_linear * s.layers
    head = s.vocab * s.hidden
    fwd = 2 * p * t + 2 * head * t
    bwd = (4 * p + 4 * head) * t if not w.lora_rank else (2 * p + 2 * head) * t
    if w.lora_rank:
        adapters = s.lora_params(w.lora_rank)
        fwd += 2 * adapters * t
        bwd += 4 * adapters * t
    skips_mm, skips_attention = selective_recompute_skips(w, o)
    if checkpointing and not skips_mm:
        bwd += 2 * p * t + (2 * adapters * t if w.lora_rank else 0)
    elif checkpointing and tiled_mlp_shards(o) > 1:
        # The saved matmul outputs spare the layer's recompute, not a tiled MLP's forward in
        # its own backward, which runs outside the checkpoint.
        mlp = s.linears[4:]
        bwd += 2 * t * s.layers * sum(a * b + (w.lora_rank * (a + b) if w.lora_rank else 0) for a, b in mlp)
    if checkpointing:
        # A tiled MLP runs forward again in its own backward, but a layer's recompute skips
        # it (its output is never read: longctx/tiled_mlp.py, OUTPUT_ONLY_ADDED): two
        # forwards, as untiled. Tiled projections are recomputed and run again: the tiled
        # MLP's footprint (offloadkit/longctx/footprint.py).
        bwd += tiled_mlp_footprint(w, o).backward_flops
    # The whole sequence's causal attention; split over ranks, each computes an even share.
    attn_fwd = 2.0 * w.batch * w.seq_len**2 * s.heads * s.head_dim * s.layers / w.parallel.sequence_ranks
    recomputed = 0 if skips_attention else 1 - keeps_attention(w, o) / s.layers
    attn_bwd = 2 * attn_fwd + (attn_fwd * recomputed if checkpointing else 0)
    replays = _replays(w, o)
    if replays:
        # A dropped input is the output of the block before it, run forward once more.
        bwd += replays * t * (2 * layer_linear + (2 * adapters // s.layers if w.lora_rank else 0))
        attn_bwd += replays * attn_fwd / s.layers
    return float(fwd), float(bwd), attn_fwd, attn_bwd


def estimate_time(w: Workload, f: StepOptions, rates: Rates, placement: list[str]) -> StepTime:
    """Predict one step's time from FLOPs and the bytes each link moves.

    Args:
        w, f: the workload and the components' options (a tuple of them: one not given has
            its defaults).
        rates: throughputs.
        placement: per layer, where its input lives ("gpu", "ram", "disk", "recompute").

    Returns:
        A :class:`StepTime`.
    """
    w, o = step_options(w, f)
    lf, lb, af, ab = step_flops(w, o)
    kernels = o.of(KernelOptions)
    linear_rate = rates.linear_flops_per_s(
        o.of(LoraOptions).fused is True and bool(w.lora_rank),
        (kernels.rms_norm is True) + (kernels.glu_activation is True),
    )
    fwd_compute = lf / linear_rate + af / rates.attention_flops_per_s
    bwd_compute = lb / linear_rate + ab / rates.attention_flops_per_s
    block = w.block_input_bytes
    moved = sum(1 for p in placement if p in ("ram", "disk")) * block  # each way
    kept = keeps_attention(w, o) * attention_kept_bytes(w)
    moved += kept
    streamed = 0
    if streams_weights(w, o):
        # Per pass: forward, then backward. A full fine-tune's updated weights go back on the
        # other direction's queue, beside the state's way back.
        streamed = w.shape.layers * w.shape.layer_params * w.dtype_bytes
    # Each rank's share of the state where FSDP2 shards it.
    shards = w.parallel.weight_shards
    moves_state = o.of(OptimizerOptions).enabled and not w.lora_rank
    state = -(-w.shape.params // shards) * w.optimizer_state_bytes if moves_state else 0
    fwd_pcie = (moved + streamed) / rates.pcie_bytes_per_s  # inputs out and weights in share the link
    # Backward's host->device queue carries the block inputs, streamed weights and optimizer
    # state; the state's way back is the other direction's queue, as long.
    in_backward = state if w.updates_in_backward else 0
    bwd_pcie = (moved + streamed + in_backward) / rates.pcie_bytes_per_s
    # Updates deferred to step() move the state each way after backward, with no compute to
    # hide behind, and read and write streamed weights where they rest in host memory.
    update_pcie = (state + streamed) / rates.pcie_bytes_per_s if state and not in_backward else 0.0
    on_disk = placement.count("disk") * block
    fwd_disk = on_disk / rates.disk_write_bytes_per_s
    bwd_disk = on_disk / rates.disk_read_bytes_per_s
    exposed = 0.0
    if offloads_inputs(o) and o.of(ActivationOptions).loading_horizon == 0:
        # Nothing is fetched ahead: each offloaded block input arrives while its layer waits.
        exposed = moved / rates.pcie_bytes_per_s + on_disk / rates.disk_read_bytes_per_s
    # Kept attention outputs are fetched as each layer's recompute starts, not ahead.
    exposed += kept / rates.pcie_bytes_per_s
    fwd_exposed = 0.0
    if streamed and o.of(StreamingOptions).depth <= 1:
        # One streamed layer resident: each layer's weights arrive while it waits, in both passes.
        fwd_exposed = streamed / rates.pcie_bytes_per_s
        exposed += streamed / rates.pcie_bytes_per_s
    # Ring attention's keys and values arrive again for every layer the recompute runs
    # attention in (not those whose outputs are kept) and for every replayed block.
    recomputes_attention = o.of(CheckpointOptions).enabled and not selective_recompute_skips(w, o)[1]
    reruns = (w.shape.layers - keeps_attention(w, o) if recomputes_attention else 0) + _replays(w, o)
    link = rates.link_bytes_per_s if w.parallel.one_host else rates.network_bytes_per_s
    rotation = ring_rotation(w.parallel, chosen_rotation(o))
    ring = ring_traffic(w, reruns, af / rates.attention_flops_per_s / w.shape.layers, link, rotation)
    # FSDP2: each rank receives the others' shards of the layers' weights in forward and again
    # in backward, and sends its gradients' reduce-scatter, prefetched a layer ahead: the link
    # sets a phase's time only where it is slower than the compute it overlaps.
    gathered = w.shape.layers * w.shape.layer_params * w.dtype_bytes * (shards - 1) // shards
    shard_link = rates.link_bytes_per_s if shards <= w.parallel.ranks_per_host else rates.network_bytes_per_s
    fwd_shard = gathered / shard_link if shards > 1 else 0.0
    bwd_shard = 2 * gathered / shard_link if shards > 1 else 0.0
    fwd = max(fwd_compute + fwd_exposed + ring.forward_wait_s, fwd_pcie, fwd_disk, fwd_shard)
    bwd = max(bwd_compute + exposed + ring.backward_wait_s, bwd_pcie, bwd_disk, bwd_shard)
    totals = {
        "compute": fwd_compute + bwd_compute,
        "pcie": fwd_pcie + bwd_pcie + update_pcie,
        "disk": fwd_disk + bwd_disk,
    }
    # The bound is the resource that sets the longest phase's time.
    phases = [
        (fwd, (fwd_compute, fwd_pcie, fwd_disk, ring.forward_wait_s, fwd_shard)),
        (bwd, (bwd_compute, bwd_pcie + exposed, bwd_disk, ring.backward_wait_s, bwd_shard)),
        (update_pcie, (0.0, update_pcie, 0.0, 0.0, 0.0)),
    ]
    _, parts = max(phases, key=lambda x: x[0])
    bound = ("compute", "pcie", "disk", "ring", "shards")[max(range(5), key=lambda k: parts[k])]
    return StepTime(
        seconds=fwd + bwd + update_pcie,
        compute_s=totals["compute"],
        pcie_s=totals["pcie"],
        disk_s=totals["disk"],
        bound=bound,
        linear_flops=lf + lb,
        attention_flops=af + ab,
        ring_s=ring.seconds,
        ring_wait_s=ring.wait_s,
        shard_s=fwd_shard + bwd_shard,
    )
