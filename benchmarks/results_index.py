"""The figures the README quotes, as data: each one read from the result file that backs it.

``CLAIMS`` declares every figure of the README's "Measured results" table: an id, what it is,
the file under ``benchmarks/results/`` and how the value is read from it (a JSON key path, a
regular expression, or the ratio of two other claims), its unit and how it is written. From
them this script writes ``benchmarks/results/INDEX.md``: each claim's figure and file, and
what each file (or a file beside it) records of the run that made it: commit, GPU, torch and
command, "not recorded" where nothing does.

    python benchmarks/results_index.py            # write INDEX.md
    python benchmarks/results_index.py --check    # exit 1 when INDEX.md is not what it would write

In README.md each figure is followed by ``<!-- claim: ID -->``; ``tests/cpu/test_results_index.py``
holds every such figure equal to the claim's value here, and INDEX.md to this script's output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "benchmarks/results"
INDEX = f"{RESULTS}/INDEX.md"
GIB = 1.0 / (1 << 30)


@dataclass(frozen=True)
class Claim:
    """One figure, read from one file.

    ``key`` is a JSON path: dots between keys, ``[N]`` for a list index and ``[k=v,...]`` for
    the one list item whose keys have those values (``probes[mode=hf_ckpt,seq_len=16384].step_s``).
    ``pattern`` is a regular expression whose first group is the number (commas allowed); it
    reads the string at ``key``, or the file's text without a key. The value is multiplied by
    ``scale`` and written with ``format(value, fmt)``. ``quoted=False``: a value only a
    :class:`Ratio` uses, which the README does not write itself."""

    id: str
    label: str
    file: str
    key: str | None = None
    pattern: str | None = None
    unit: str = ""
    scale: float = 1.0
    fmt: str = ".2f"
    quoted: bool = True


@dataclass(frozen=True)
class Ratio:
    """One claim's value over another's (minus 1 with ``change``, for a relative change)."""

    id: str
    label: str
    num: str
    den: str
    unit: str = "x"
    fmt: str = ".3f"
    change: bool = False
    quoted: bool = True


@dataclass(frozen=True)
class Recorded:
    """Where a file's provenance is written down when the file itself does not say: a file
    (relative to the repository) and a regular expression whose first group is the value.
    Lines ending in a backslash are joined first, so a command split over lines reads whole."""

    file: str
    pattern: str


def _r(path: str) -> str:
    return f"{RESULTS}/{path}"


_CAP = _r("longctx/capacity-8b-lora-h100.json")
_512K = _r("longctx/512k/capacity-512k.json")
_H100_EDGE = _r("longctx/calibrated/h100-7b55b6a/edge-859136.json")
_H200_EDGE = _r("longctx/calibrated/h200-2deafd8/edge-1417216-4L.json")
_MACHINERY = _r("machinery/machinery-h200.json")
_PEERS = _r("full-ft/peers/full-ft-peers.json")
_PEERS_DEFAULT = _r("full-ft/peers/offloadkit-default-window.json")
_RESIDENT = _r("full-ft/streamed/bf16-16k-report.json")
_STREAMED = _r("full-ft/streamed/streamed-bf16-16k-report.json")
_WEIGHTS = _r("weights/weights-offload.json")
_FIRST = _r("first-run/gpu/report.json")
_CP2 = _r("multi-gpu/h200x4-d6af501/cp-llama-3-8b-2x819200-1L.json")
_CP4 = _r("multi-gpu/h200x4-7c17d82/cp/cp-llama-3-8b-4x795136-1L.json")
_PEER4_LONGEST = _r("multi-gpu/h200x4-7c17d82/cp/peer-llama-3-8b-4x32768-32L.json")
_PEER4_SIDE = _r("multi-gpu/h200x4-7c17d82/cp/peer-llama-3-8b-4x32768-4L.json")
_OURS4_SIDE = _r("multi-gpu/h200x4-7c17d82/cp/cp-llama-3-8b-4x32768-4L-fused.json")
_FSDP2 = "multi-gpu/h200x4-7c17d82/fsdp2/fsdp2-llama-3-8b-4x"
_FSDP2_SAME = "multi-gpu/h200x4-b695acf/same-run/"
_FSDP2_16K = _r(_FSDP2_SAME + "fsdp2_4x16k.txt")
_FSDP2_16K_2 = _r(_FSDP2_SAME + "fsdp2_2x16k.txt")
_FSDP2_64K = _r(_FSDP2 + "65536-ckpt+input_offload+backward_adamw.json")
_CPUOFF_16K = _r("multi-gpu/h200x4-893588b/fsdp2-llama-3-8b-4x16384-cpu_offload_policy.json")
_CPUOFF_64K = _r("multi-gpu/h200x4-893588b/fsdp2-llama-3-8b-4x65536-cpu_offload_policy.json")
_CP_SCALE1 = _r("multi-gpu/h200x4-310d2e2/cp-llama-3-8b-1x131072-2L.json")
_CP_SCALE4 = _r("multi-gpu/h200x4-310d2e2/cp-llama-3-8b-4x131072-2L.json")
_CP_FULL1 = _r("multi-gpu/h200x4-2a931d1/cp/cp-llama-3-8b-1x131072-32L.json")
_CP_FULL2 = _r("multi-gpu/h200x4-2a931d1/cp/cp-llama-3-8b-2x131072-32L.json")
_CP_FULL4 = _r("multi-gpu/h200x4-b695acf/cp/cp-llama-3-8b-4x131072-32L.json")
_FOOT4 = _r("multi-gpu/h200x4-b695acf/footprint/footprint-llama-3-8b-5289984-rank0of4.json")
_FOOT4_CAPPED = _r("multi-gpu/h200x4-3dddea8/footprint/footprint-llama-3-8b-3180544-rank1of4.json")
_FUSED = _r("fused-lora/h100-caa6bbc/summary.json")
_LIGER = "compute/h100-3dddea8/rows/"
_LIGER_64K_EAGER = _r(_LIGER + "auto-65536-32L-eager.json")
_LIGER_64K = _r(_LIGER + "auto-65536-32L-liger.json")
_LIGER_256K = _r(_LIGER + "auto-262144-2L-liger.json")
_AXO = "compute/h200-8c50f37/"
_AXO_64K = _r(_AXO + "axolotl/axolotl-stack-llama-3-8b-65536-32L-hidden_states.json")
_AXO_256K = _r(_AXO + "axolotl/axolotl-stack-llama-3-8b-262144-2L-hidden_states.json")
_OURS_64K = _r(_AXO + "rows/auto-65536-32L-liger.json")
_OURS_256K = _r(_AXO + "rows/auto-262144-2L-liger.json")
_FA4 = "compute/h200-589abb9/rows/"
_FA4_64K = _r(_FA4 + "auto-65536-32L-liger-fa4.json")
_FA4_256K = _r(_FA4 + "auto-262144-2L-liger-fa4.json")
_LONGEST = "longest sequence that fits: ([0-9]+) tokens"
_REACHED = "reached ([0-9]+)%"


def _probe(mode: str, seq: int, layers: int, field: str) -> str:
    return f"probes[mode={mode},seq_len={seq},layers={layers}].{field}"


def _auto_claims(prefix: str, what: str, file: str, seq: int, layers: int) -> list[Claim | Ratio]:
    """An ``auto`` probe's step (``PREFIX-step``) and peak allocated (``PREFIX-peak``)."""
    return [
        Claim(f"{prefix}-step", f"{what}: step", file, _probe("auto", seq, layers, "step_s"), unit="s"),
        Claim(
            f"{prefix}-peak",
            "the same: peak allocated",
            file,
            _probe("auto", seq, layers, "peak_allocated_gib"),
            unit="GiB",
        ),
    ]


def _side_by_side(tag: str, seq: int, layers: int, axolotl: str, ours: str) -> list[Claim | Ratio]:
    """Axolotl's stack and ``offload_plan: auto`` (Liger's kernels) at one length, one call."""
    what = f"8B LoRA, {tag.upper()}, {layers} layers"
    return [
        Claim(f"axo-{tag}-step", f"{what}, Axolotl's stack: step", axolotl, "step_s", unit="s"),
        Claim(f"axo-{tag}-peak", "the same: peak allocated", axolotl, "peak_allocated_gib", unit="GiB"),
        *_auto_claims(f"ours-{tag}", f"{what}, auto with Liger's kernels, same call", ours, seq, layers),
        Ratio(
            f"ours-{tag}-vs-axo",
            f"offloadkit against Axolotl's stack at {tag.upper()}: step",
            f"ours-{tag}-step",
            f"axo-{tag}-step",
        ),
    ]


def _fa4_rows(tag: str, seq: int, layers: int, fa4: str) -> list[Claim | Ratio]:
    """``offload_plan: auto`` with Liger's kernels and ``attention_kernel: fa4``, against the
    same rows with PyTorch's default kernel (:func:`_side_by_side`'s)."""
    what = f"8B LoRA, {tag.upper()}, {layers} layers, attention_kernel: fa4"
    return [
        *_auto_claims(f"fa4-{tag}", what, fa4, seq, layers),
        Ratio(
            f"fa4-{tag}-vs-default",
            f"FlashAttention-4 against the default kernel at {tag.upper()}: step",
            f"fa4-{tag}-step",
            f"ours-{tag}-step",
        ),
    ]


CLAIMS: list[Claim | Ratio] = [
    # PEFT's LoRA path against fused_lora, 8B LoRA r=16 at 2 layers, one H100.
    Claim("fused-64k-peft-step", "8B LoRA, 64K, 2 layers, one H100, PEFT's path: step", _FUSED,
          "rows[seq_len=65536,mode=peft].step_s", unit="s"),
    Claim("fused-64k-peft-peak", "8B LoRA, 64K, 2 layers, one H100, PEFT's path: peak allocated", _FUSED,
          "rows[seq_len=65536,mode=peft].peak_allocated_gib", unit="GiB", fmt=".2f"),
    Claim("fused-64k-step", "8B LoRA, 64K, 2 layers, one H100, fused_lora: step", _FUSED,
          "rows[seq_len=65536,mode=fused].step_s", unit="s"),
    Claim("fused-64k-peak", "8B LoRA, 64K, 2 layers, one H100, fused_lora: peak allocated", _FUSED,
          "rows[seq_len=65536,mode=fused].peak_allocated_gib", unit="GiB", fmt=".2f"),
    Claim("fused-256k-peft-step", "8B LoRA, 256K, 2 layers, one H100, PEFT's path: step", _FUSED,
          "rows[seq_len=262144,mode=peft].step_s", unit="s", fmt=".2f"),
    Claim("fused-256k-peft-peak", "8B LoRA, 256K, 2 layers, one H100, PEFT's path: peak allocated", _FUSED,
          "rows[seq_len=262144,mode=peft].peak_allocated_gib", unit="GiB", fmt=".2f"),
    Claim("fused-256k-step", "8B LoRA, 256K, 2 layers, one H100, fused_lora: step", _FUSED,
          "rows[seq_len=262144,mode=fused].step_s", unit="s", fmt=".2f"),
    Claim("fused-256k-peak", "8B LoRA, 256K, 2 layers, one H100, fused_lora: peak allocated", _FUSED,
          "rows[seq_len=262144,mode=fused].peak_allocated_gib", unit="GiB", fmt=".2f"),
    # Liger's norm and gated-MLP kernels under offload_plan: auto, 8B LoRA r=16, one H100.
    Claim("liger-64k-eager-step", "8B LoRA, 64K, 32 layers, one H100, auto without Liger's kernels: step",
          _LIGER_64K_EAGER, _probe("auto", 65536, 32, "step_s"), unit="s", fmt=".2f"),
    Claim("liger-64k-eager-peak", "the same: peak allocated", _LIGER_64K_EAGER,
          _probe("auto", 65536, 32, "peak_allocated_gib"), unit="GiB", fmt=".2f"),
    Claim("liger-64k-step", "8B LoRA, 64K, 32 layers, one H100, auto with Liger's kernels: step", _LIGER_64K,
          _probe("auto", 65536, 32, "step_s"), unit="s", fmt=".2f"),
    Claim("liger-64k-peak", "the same: peak allocated", _LIGER_64K,
          _probe("auto", 65536, 32, "peak_allocated_gib"), unit="GiB", fmt=".2f"),
    Ratio("liger-64k-vs-eager", "Liger's kernels against without: step", "liger-64k-step", "liger-64k-eager-step"),
    Claim("liger-256k-step", "8B LoRA, 256K, 2 layers, one H100, auto with Liger's kernels: step", _LIGER_256K,
          _probe("auto", 262144, 2, "step_s"), unit="s", fmt=".2f"),
    Claim("liger-256k-peak", "the same: peak allocated", _LIGER_256K,
          _probe("auto", 262144, 2, "peak_allocated_gib"), unit="GiB", fmt=".2f"),
    # Axolotl's long-context stack and offload_plan: auto in one call, one H200 capped to 79 GiB.
    *_side_by_side("64k", 65536, 32, _AXO_64K, _OURS_64K),
    *_side_by_side("256k", 262144, 2, _AXO_256K, _OURS_256K),
    # The same rows with FlashAttention-4 (attention_kernel: fa4), same kind of machine and cap.
    *_fa4_rows("64k", 65536, 32, _FA4_64K),
    *_fa4_rows("256k", 262144, 2, _FA4_256K),
    # Context parallelism, 8B LoRA on H200s capped to 79 GiB a rank, 1 layer timed.
    Claim("cp2-tokens", "8B LoRA, context parallel over 2 GPUs: tokens", _CP2, "tokens", unit="tokens", fmt=",.0f"),
    Claim("cp2-step", "8B LoRA, context parallel over 2 GPUs, 1 layer: step", _CP2, "step_s", unit="s"),
    Claim("cp2-peak", "8B LoRA, context parallel over 2 GPUs: a rank's peak allocated", _CP2,
          "peak_allocated_gib[0]", unit="GiB"),
    Claim("cp4-tokens", "8B LoRA, context parallel over 4 GPUs: the planner's longest", _CP4, "tokens", unit="tokens",
          fmt=",.0f"),
    Claim("cp4-allowed", "8B LoRA, context parallel over 4 GPUs: what the budgets physically allow", _CP4,
          "planner_physical_limit", unit="tokens", fmt=",.0f"),
    Claim("cp4-step", "8B LoRA, context parallel over 4 GPUs, 1 layer: step", _CP4, "step_s", unit="s"),
    Claim("cp4-peak", "8B LoRA, context parallel over 4 GPUs: a rank's peak allocated", _CP4,
          "peak_allocated_gib[0]", unit="GiB"),
    # The peer side by side on 4 GPUs: accelerate's FSDP2 + context parallel.
    Claim("peer4-longest", "8B LoRA, accelerate FSDP2 + CP over 4 GPUs, full depth: longest that ran", _PEER4_LONGEST,
          "tokens", unit="tokens", fmt=",.0f"),
    Claim("peer4-side-step", "8B LoRA, 4 x 32K, 4 layers, accelerate FSDP2 + CP: step", _PEER4_SIDE, "step_s",
          unit="s"),
    Claim("peer4-side-peak", "8B LoRA, 4 x 32K, 4 layers, accelerate FSDP2 + CP: a rank's peak allocated",
          _PEER4_SIDE, "peak_allocated_gib[0]", unit="GiB"),
    Claim("ours4-side-step", "8B LoRA, 4 x 32K, 4 layers, offloadkit (planner + fused_lora): step", _OURS4_SIDE,
          "step_s", unit="s"),
    Claim("ours4-side-peak", "8B LoRA, 4 x 32K, 4 layers, offloadkit: a rank's peak allocated", _OURS4_SIDE,
          "peak_allocated_gib[0]", unit="GiB"),
    Ratio("ours4-side-vs-peer", "8B LoRA, 4 x 32K: offloadkit's step over the peer's", "ours4-side-step",
          "peer4-side-step", fmt=".2f"),
    # 8B full fine-tune under FSDP2 over 4 GPUs, bf16 weights.
    Claim("fsdp2-8b-hf-step", "8B full FT, FSDP2 over 4 GPUs, 16K a rank, HF checkpointing: step", _FSDP2_16K,
          pattern=r"\| hf_ckpt \| ([0-9.]+) \|", unit="s", fmt=".2f"),
    Claim("fsdp2-8b-hf-peak", "8B full FT, FSDP2 over 4 GPUs, 16K a rank, HF checkpointing: peak", _FSDP2_16K,
          pattern=r"\| hf_ckpt \|[^|]+\|[^|]+\|[^|]+\| ([0-9.]+),", unit="GiB", fmt=".1f"),
    Claim("fsdp2-8b-step", "8B full FT, FSDP2 over 4 GPUs, 16K a rank, offloadkit: step", _FSDP2_16K,
          pattern=r"\| ckpt\+input_offload\+backward_adamw \| ([0-9.]+) \|", unit="s", fmt=".2f"),
    Claim("fsdp2-8b-peak", "8B full FT, FSDP2 over 4 GPUs, 16K a rank, offloadkit: peak", _FSDP2_16K,
          pattern=r"\| ckpt\+input_offload\+backward_adamw \|[^|]+\|[^|]+\|[^|]+\| ([0-9.]+),", unit="GiB",
          fmt=".1f"),
    Ratio("fsdp2-8b-vs-hf", "8B full FT, FSDP2 over 4 GPUs, 16K: offloadkit's step over HF checkpointing's",
          "fsdp2-8b-step", "fsdp2-8b-hf-step", fmt=".3f"),
    Claim("fsdp2-8b-2-hf-step", "8B full FT, FSDP2 over 2 GPUs, 16K a rank, HF checkpointing: step", _FSDP2_16K_2,
          pattern=r"\| hf_ckpt \| ([0-9.]+) \|", unit="s", fmt=".3f", quoted=False),
    Claim("fsdp2-8b-2-step", "8B full FT, FSDP2 over 2 GPUs, 16K a rank, offloadkit: step", _FSDP2_16K_2,
          pattern=r"\| ckpt\+input_offload\+backward_adamw \| ([0-9.]+) \|", unit="s", fmt=".3f", quoted=False),
    Ratio("fsdp2-8b-2-vs-hf", "8B full FT, FSDP2 over 2 GPUs, 16K: offloadkit's step over HF checkpointing's",
          "fsdp2-8b-2-step", "fsdp2-8b-2-hf-step", fmt=".3f"),
    Claim("fsdp2-8b-cpuoff-step", "8B full FT, FSDP2 CPUOffloadPolicy over 4 GPUs, 16K a rank: step", _CPUOFF_16K,
          "rows[mode=cpu_offload_policy].step_s", unit="s", fmt=".2f"),
    Claim("fsdp2-8b-64k-peak", "8B full FT, FSDP2 over 4 GPUs, 64K a rank, offloadkit: peak", _FSDP2_64K,
          "rows[mode=ckpt+input_offload+backward_adamw].peak_allocated_gib[0]", unit="GiB", fmt=".1f"),
    Claim("fsdp2-8b-cpuoff-64k-peak", "8B full FT, FSDP2 CPUOffloadPolicy over 4 GPUs, 64K a rank: peak",
          _CPUOFF_64K, "rows[mode=cpu_offload_policy].peak_allocated_gib[0]", unit="GiB", fmt=".1f"),
    Claim("cp-scale1-tflops", "128K a GPU, 2 layers: one GPU's model TFLOP/s", _CP_SCALE1, "model_tflops_per_gpu",
          fmt=".0f", quoted=False),
    Claim("cp-scale4-tflops", "128K a GPU, 2 layers: model TFLOP/s per GPU over 4", _CP_SCALE4,
          "model_tflops_per_gpu", fmt=".0f", quoted=False),
    Ratio("cp-scale4", "weak scaling at 128K a GPU: 4 GPUs' model TFLOP/s per GPU over one GPU's",
          "cp-scale4-tflops", "cp-scale1-tflops", fmt=".2f"),
    Claim("cp-full1-tflops", "128K a GPU, 32 layers: one GPU's model TFLOP/s", _CP_FULL1, "model_tflops_per_gpu",
          fmt=".0f", quoted=False),
    Claim("cp-full2-tflops", "128K a GPU, 32 layers: model TFLOP/s per GPU over 2", _CP_FULL2,
          "model_tflops_per_gpu", fmt=".0f", quoted=False),
    Ratio("cp-full2", "weak scaling at 128K a GPU, full depth: 2 GPUs' model TFLOP/s per GPU over one GPU's",
          "cp-full2-tflops", "cp-full1-tflops", fmt=".2f"),
    Claim("cp-full4-tflops", "128K a GPU, 32 layers: model TFLOP/s per GPU over 4", _CP_FULL4,
          "model_tflops_per_gpu", fmt=".0f", quoted=False),
    Ratio("cp-full4", "weak scaling at 128K a GPU, full depth: 4 GPUs' model TFLOP/s per GPU over one GPU's",
          "cp-full4-tflops", "cp-full1-tflops", fmt=".2f"),
    # The full-depth host and disk footprint of the planner's longest over 4 uncapped H200s (stand-in compute).
    Claim("foot4-tokens", "8B LoRA over 4 H200s: the planner's longest, full-depth footprint run", _FOOT4, "seq_len",
          unit="tokens", fmt=",.0f"),
    Claim("foot4-rss", "8B LoRA over 4 H200s, full-depth footprint: a rank's peak RSS", _FOOT4, "peak_rss_gib",
          unit="GiB", fmt=".1f"),
    Claim("foot4-disk", "8B LoRA over 4 H200s, full-depth footprint: a rank's bytes on disk", _FOOT4,
          "disk_written_gib", unit="GiB", fmt=".1f"),
    Claim("foot4cap-tokens", "8B LoRA over 4 H200s capped to 79 GiB: the planner's longest, full-depth footprint run",
          _FOOT4_CAPPED, "seq_len", unit="tokens", fmt=",.0f"),
    Claim("foot4cap-rss", "the same: a rank's peak RSS (the highest of the 4)", _FOOT4_CAPPED, "peak_rss_gib",
          unit="GiB", fmt=".1f"),
    Claim("foot4cap-disk", "the same: a rank's bytes on disk", _FOOT4_CAPPED, "disk_written_gib", unit="GiB",
          fmt=".1f"),
    # 8B LoRA at 16K and 32K on one H100, Hugging Face checkpointing against everything on.
    Claim("lora8b-16k-hf-step", "8B LoRA, 16K, one H100, HF checkpointing: step", _CAP,
          _probe("hf_ckpt", 16384, 32, "step_s"), unit="s"),
    Claim("lora8b-16k-hf-peak", "8B LoRA, 16K, one H100, HF checkpointing: peak allocated", _CAP,
          _probe("hf_ckpt", 16384, 32, "peak_allocated_gib"), unit="GiB"),
    Claim("lora8b-16k-step", "8B LoRA, 16K, one H100, everything: step", _CAP,
          _probe("everything", 16384, 32, "step_s"), unit="s"),
    Ratio("lora8b-16k-vs-hf", "8B LoRA, 16K, one H100: everything's step over HF checkpointing's",
          "lora8b-16k-step", "lora8b-16k-hf-step"),
    Claim("lora8b-16k-peak", "8B LoRA, 16K, one H100, everything: peak allocated", _CAP,
          _probe("everything", 16384, 32, "peak_allocated_gib"), unit="GiB"),
    Claim("lora8b-32k-hf-step", "8B LoRA, 32K, one H100, HF checkpointing: step", _CAP,
          _probe("hf_ckpt", 32768, 32, "step_s"), unit="s"),
    Claim("lora8b-32k-hf-peak", "8B LoRA, 32K, one H100, HF checkpointing: peak allocated", _CAP,
          _probe("hf_ckpt", 32768, 32, "peak_allocated_gib"), unit="GiB"),
    Claim("lora8b-32k-step", "8B LoRA, 32K, one H100, everything: step", _CAP,
          _probe("everything", 32768, 32, "step_s"), unit="s"),
    Claim("lora8b-32k-peak", "8B LoRA, 32K, one H100, everything: peak allocated", _CAP,
          _probe("everything", 32768, 32, "peak_allocated_gib"), unit="GiB"),
    # 512K on one H100 (2 layers timed).
    Claim("lora8b-512k-step", "8B LoRA, 512K, one H100, 2 layers: step", _512K,
          _probe("everything", 524288, 2, "step_s"), unit="s"),
    Claim("lora8b-512k-peak", "8B LoRA, 512K, one H100, 2 layers: peak allocated", _512K,
          _probe("everything", 524288, 2, "peak_allocated_gib"), unit="GiB"),
    Claim("lora8b-512k-inputs-ram", "8B LoRA, 512K, full depth: block inputs in pinned RAM",
          _r("longctx/512k/README.md"), pattern=r"go [0-9]+ to disk and ([0-9]+) to pinned RAM", fmt=".0f"),
    Claim("lora8b-512k-inputs-disk", "8B LoRA, 512K, full depth: block inputs on disk",
          _r("longctx/512k/README.md"), pattern=r"go ([0-9]+) to disk and [0-9]+ to pinned RAM", fmt=".0f"),
    # The planner's longest on the H100's and on an H200's budgets.
    Claim("longest-h100-tokens", "8B LoRA, the planner's longest on the H100's budgets", _H100_EDGE,
          "capacity", _LONGEST, unit="tokens", fmt=",.0f"),
    Claim("longest-h100-share", "the H100's longest, of what its budgets physically allow", _H100_EDGE,
          "capacity", _REACHED, scale=0.01, fmt=".0%"),
    Claim("longest-h100-allowed", "tokens the H100's budgets physically allow", _H100_EDGE,
          "capacity", "physically allowed by the budgets: ([0-9]+) tokens", unit="tokens", fmt=",.0f"),
    Claim("longest-h100-layers", "the H100's longest: layers timed", _H100_EDGE,
          _probe("everything", 859136, 3, "layers"), fmt=".0f"),
    Claim("longest-h100-step", "the H100's longest: step", _H100_EDGE,
          _probe("everything", 859136, 3, "step_s"), unit="s"),
    Claim("longest-h100-peak", "the H100's longest: peak allocated", _H100_EDGE,
          _probe("everything", 859136, 3, "peak_allocated_gib"), unit="GiB"),
    Claim("longest-h200-tokens", "8B LoRA, the planner's longest on an H200's budgets", _H200_EDGE,
          "capacity", _LONGEST, unit="tokens", fmt=",.0f"),
    Claim("longest-h200-share", "the H200's longest, of what its budgets physically allow", _H200_EDGE,
          "capacity", _REACHED, scale=0.01, fmt=".0%"),
    Claim("longest-h200-layers", "the H200's longest: layers timed", _H200_EDGE,
          _probe("everything", 1417216, 4, "layers"), fmt=".0f"),
    Claim("longest-h200-step", "the H200's longest: step", _H200_EDGE,
          _probe("everything", 1417216, 4, "step_s"), unit="s", fmt=".0f"),
    Claim("longest-h200-peak", "the H200's longest: peak allocated", _H200_EDGE,
          _probe("everything", 1417216, 4, "peak_allocated_gib"), unit="GiB", fmt=".1f"),
    # What the machinery costs where the step fits without it (one H200, 32K).
    Claim("machinery-32k-in-gpu-step", "8B LoRA, 32K, one H200, nothing moved: step", _MACHINERY,
          _probe("in_gpu", 32768, 32, "step_s"), unit="s"),
    Claim("machinery-32k-in-gpu-peak", "8B LoRA, 32K, one H200, nothing moved: peak allocated", _MACHINERY,
          _probe("in_gpu", 32768, 32, "peak_allocated_gib"), unit="GiB", fmt=".1f"),
    Claim("machinery-32k-step", "8B LoRA, 32K, one H200, inputs offloaded and layers streamed: step",
          _MACHINERY, _probe("everything", 32768, 32, "step_s"), unit="s"),
    Ratio("machinery-32k-cost", "8B LoRA, 32K, one H200: what offloading and streaming add to the step",
          "machinery-32k-step", "machinery-32k-in-gpu-step", unit="", fmt=".1%", change=True),
    Claim("machinery-32k-peak", "8B LoRA, 32K, one H200, inputs offloaded and layers streamed: peak allocated",
          _MACHINERY, _probe("everything", 32768, 32, "peak_allocated_gib"), unit="GiB", fmt=".1f"),
    # Full fine-tune, fp32 master weights, 16K, one H200, against FSDP2 and DeepSpeed.
    Claim("fullft3b-fsdp2-step", "3B full fine-tune, 16K, one H200, FSDP2 CPUOffloadPolicy: step", _PEERS,
          "[mode=fsdp2_cpu_offload,shape=llama-3.2-3b].step_s", unit="s"),
    Claim("fullft3b-zero2-step", "3B full fine-tune, 16K, one H200, DeepSpeed ZeRO-2 offload: step", _PEERS,
          "[mode=deepspeed_zero2_offload,shape=llama-3.2-3b].step_s", unit="s"),
    Claim("fullft3b-zero3-step", "3B full fine-tune, 16K, one H200, DeepSpeed ZeRO-3 offload: step", _PEERS,
          "[mode=deepspeed_zero3_offload,shape=llama-3.2-3b].step_s", unit="s"),
    Claim("fullft3b-step", "3B full fine-tune, 16K, one H200, offloadkit (default window): step",
          _PEERS_DEFAULT, "[mode=offloadkit,shape=llama-3.2-3b].step_s", unit="s"),
    Ratio("fullft3b-vs-fsdp2", "3B full fine-tune: FSDP2's step over offloadkit's",
          "fullft3b-fsdp2-step", "fullft3b-step", fmt=".1f"),
    Ratio("fullft3b-vs-zero3", "3B full fine-tune: DeepSpeed ZeRO-3's step over offloadkit's",
          "fullft3b-zero3-step", "fullft3b-step", fmt=".1f"),
    Claim("fullft8b-peer-host-state", "8B full fine-tune: the host state FSDP2 and DeepSpeed need", _PEERS,
          "[mode=fsdp2_cpu_offload,shape=llama-3-8b].host_state_gib", unit="GiB", fmt=".0f"),
    Claim("fullft8b-step", "8B full fine-tune, 16K, one H200, offloadkit with chunked loss: step",
          _PEERS_DEFAULT, "[mode=offloadkit+chunked_loss,shape=llama-3-8b].step_s", unit="s"),
    Claim("fullft8b-peak", "8B full fine-tune, 16K, one H200, offloadkit with chunked loss: peak allocated",
          _PEERS_DEFAULT, "[mode=offloadkit+chunked_loss,shape=llama-3-8b].peak_allocated_gib", unit="GiB",
          fmt=".1f"),
    Claim("fullft8b-host-rss", "8B full fine-tune, 16K, one H200, offloadkit with chunked loss: host peak RSS",
          _PEERS_DEFAULT, "[mode=offloadkit+chunked_loss,shape=llama-3-8b].host_peak_rss_gib", unit="GiB",
          fmt=".1f"),
    # 8B full fine-tune, pure bf16, weights on the GPU against weights streamed (offloadkit train).
    Claim("bf16-8b-resident-step", "8B bf16 full fine-tune, 16K, one H200, weights on the GPU: step",
          _RESIDENT, "median_step_s", unit="s"),
    Claim("bf16-8b-resident-peak", "the same, weights on the GPU: peak allocated", _RESIDENT,
          "peak_gpu_bytes", unit="GiB", scale=GIB, fmt=".1f"),
    Claim("bf16-8b-resident-reserved", "the same, weights on the GPU: peak reserved", _RESIDENT,
          "peak_gpu_reserved_bytes", unit="GiB", scale=GIB, fmt=".1f"),
    Claim("bf16-8b-streamed-step", "8B bf16 full fine-tune, 16K, one H200, weights streamed: step",
          _STREAMED, "median_step_s", unit="s"),
    Ratio("bf16-8b-streamed-cost", "8B bf16 full fine-tune: what streaming the weights adds to the step",
          "bf16-8b-streamed-step", "bf16-8b-resident-step", unit="", fmt="+.1%", change=True),
    Claim("bf16-8b-streamed-peak", "the same, weights streamed: peak allocated", _STREAMED,
          "peak_gpu_bytes", unit="GiB", scale=GIB, fmt=".1f"),
    Claim("bf16-8b-streamed-reserved", "the same, weights streamed: peak reserved", _STREAMED,
          "peak_gpu_reserved_bytes", unit="GiB", scale=GIB, fmt=".1f"),
    # Reserved against allocated through prepare(), before expandable segments.
    Claim("reserved-fixed-segments", "3B full fine-tune, 16K, through prepare(), one H100: reserved over "
          "allocated with fixed-size segments", _r("full-ft/reserved-h100-df4d55f/README.md"),
          pattern=r"bf16 moments, through `prepare\(\)`[^\n]*\| ([0-9.]+)x -> [0-9.]+x \|", unit="x"),
    # The same through prepare() with the optimizer state arena (H200).
    Claim("reserved-arena-allocated", "3B full fine-tune, 16K, through prepare(), one H200, the state arena: "
          "peak allocated", _r("full-ft/waits-and-reserved-h200/trainer-overheads-arena-sized-94444b5.json"),
          "records[case=fullft-prepare].peak_allocated_gib", unit="GiB", quoted=False),
    Claim("reserved-arena-reserved", "the same: peak reserved",
          _r("full-ft/waits-and-reserved-h200/trainer-overheads-arena-sized-94444b5.json"),
          "records[case=fullft-prepare].peak_reserved_gib", unit="GiB", quoted=False),
    Ratio("reserved-arena", "the same: reserved over allocated", "reserved-arena-reserved",
          "reserved-arena-allocated", fmt=".2f"),
    # Frozen weights off the GPU: layer streaming against FSDP2's CPU offload.
    Claim("weights-resident-step", "8B LoRA, 16K, one H100, frozen weights resident: step", _WEIGHTS,
          "rows[mode=resident].step_s", unit="s", fmt=".3f", quoted=False),
    Claim("weights-fsdp2-step", "the same, FSDP2 CPUOffloadPolicy: step", _WEIGHTS,
          "rows[mode=fsdp2_cpu_offload].step_s", unit="s", fmt=".3f", quoted=False),
    Claim("weights-streamed-step", "the same, layer streaming: step", _WEIGHTS,
          "rows[mode=layer_streaming].step_s", unit="s", fmt=".3f", quoted=False),
    Ratio("weights-fsdp2-vs-resident", "FSDP2's CPU offload: step over the resident step",
          "weights-fsdp2-step", "weights-resident-step"),
    Claim("weights-streamed-off", "layer streaming: frozen weights off the GPU", _WEIGHTS,
          "rows[mode=layer_streaming].streamed_weights_gib", unit="GiB", fmt=".1f"),
    Ratio("weights-streamed-vs-resident", "layer streaming: step over the resident step",
          "weights-streamed-step", "weights-resident-step"),
    # The default run, offloadkit train, on one H100.
    Claim("first-run-peak-without", "the default run, one H100, without offloadkit: peak allocated", _FIRST,
          "comparison.peak_bytes[0]", unit="GiB", scale=GIB, fmt=".3f"),
    Claim("first-run-step-without", "the default run, without offloadkit: step", _FIRST,
          "comparison.median_step_s[0]", unit="s", fmt=".3f"),
    Claim("first-run-peak-with", "the default run, with offloadkit: peak allocated", _FIRST,
          "comparison.peak_bytes[1]", unit="GiB", scale=GIB, fmt=".3f"),
    Claim("first-run-peak-change", "the default run: change in peak", _FIRST, "comparison.peak_change",
          fmt="+.0%"),
    Claim("first-run-step-with", "the default run, with offloadkit: step", _FIRST,
          "comparison.median_step_s[1]", unit="s", fmt=".3f"),
    Claim("first-run-step-change", "the default run: change in step time", _FIRST, "comparison.time_change",
          fmt="+.0%"),
]  # fmt: skip

# Provenance a result file does not hold itself, where a file beside it writes it down.
_ARENA_README = _r("full-ft/waits-and-reserved-h200/README.md")
RECORDED: dict[str, dict[str, Recorded]] = {
    _r("full-ft/waits-and-reserved-h200/trainer-overheads-arena-sized-94444b5.json"): {
        "commit": Recorded(_ARENA_README, r"arena_sized\.sh` at ([0-9a-f]{7,40})"),
        "command": Recorded(_ARENA_README, r"`(bash benchmarks/device/arena_sized\.sh)`"),
    },
    _512K: {"command": Recorded(_r("longctx/512k/README.md"), r"`(bash benchmarks/device/longctx_512k\.sh)`")},
    _r("longctx/512k/README.md"): {
        "command": Recorded(_r("longctx/512k/README.md"), r"`(bash benchmarks/device/longctx_512k\.sh)`")
    },
    _H100_EDGE: {
        "command": Recorded(
            _r("longctx/past-750k-h100/README.md"), r"\n\s+(bash benchmarks/device/capacity_past_750k\.sh)"
        )
    },
    _H200_EDGE: {
        "commit": Recorded(_r("longctx/calibrated/README.md"), r"\n- H200, tree ([0-9a-f]{7,40}):"),
        "command": Recorded(
            _r("longctx/calibrated/README.md"), r"\n\s+(PYTORCH_CUDA_ALLOC_CONF=[^\n#]*edge-1417216-4L[^\n#]*?)\s+#"
        ),
    },
    _RESIDENT: {"command": Recorded(_r("full-ft/README.md"), r"Command:\s*`(RUNS=\"streamed-bf16-16k [^`]*)`")},
    _STREAMED: {"command": Recorded(_r("full-ft/README.md"), r"Command:\s*`(RUNS=\"streamed-bf16-16k [^`]*)`")},
    _WEIGHTS: {"command": Recorded(_r("weights/README.md"), r"\n\s+(torchrun [^\n]*weights_offload\.py[^\n]*)")},
    _FSDP2_16K: {
        "commit": Recorded(_r(_FSDP2_SAME + "command.txt"), r"^commit ([0-9a-f]{7,40})"),
        "command": Recorded(_r(_FSDP2_SAME + "command.txt"), r"\n  (torchrun [^\n]*?)\s*>"),
    },
    _FSDP2_16K_2: {
        "commit": Recorded(_r(_FSDP2_SAME + "command.txt"), r"^commit ([0-9a-f]{7,40})"),
        "command": Recorded(_r(_FSDP2_SAME + "command.txt"), r"\n  (torchrun [^\n]*?)\s*>"),
    },
    _FIRST: {
        "commit": Recorded(_r("first-run/README.md"), r"GPU figures \(`gpu/`, library code of ([0-9a-f]{7,40})"),
        "command": Recorded(_r("first-run/README.md"), r"GPU figures \(`gpu/`, [^)]*?made by `([^`]+)`"),
    },
}

FIELDS = ("commit", "gpu", "torch", "command")
_FIELD_NAMES = {"commit": "commit", "gpu": "GPU", "torch": "torch", "command": "command"}
# The keys a result file may hold each field under, at its top level or under "provenance".
_JSON_KEYS = {
    "commit": ("commit", "git_commit"),
    "gpu": ("gpu", "device"),
    "torch": ("torch",),
    "command": ("command", "argv"),
}
_VERSION = re.compile(r"^[0-9]+\.[0-9]+(\.[0-9]+)?([.+][0-9A-Za-z.]+)?$")
_GPU = re.compile(r"(NVIDIA [A-Z][0-9]+[^,;()\n]*?)(?= total|,|;|\)|\n|$)")
_TORCH = re.compile(r"torch ([0-9]+\.[0-9]+[0-9A-Za-z.+]*)")
_COMMAND = re.compile(r"Command[^:\n`]*:\s*`([^`]+)`")


class ClaimError(Exception):
    """A claim cannot be read from its file."""


def _path(rel: str) -> str:
    return os.path.join(REPO, rel)


def _text(rel: str) -> str:
    with open(_path(rel), encoding="utf-8") as f:
        return f.read()


def _load_json(rel: str) -> Any:
    return json.loads(_text(rel))


_STEP = re.compile(r"\.?([^.\[\]]+)|\[([^\]]+)\]")


def lookup(data: Any, key: str) -> Any:
    """The value at ``key`` (see :class:`Claim`) in parsed JSON; KeyError when there is none."""
    pos = 0
    while pos < len(key):
        m = _STEP.match(key, pos)
        if m is None:
            raise KeyError(f"cannot read the key path {key!r} at {key[pos:]!r}")
        pos = m.end()
        name, inside = m.group(1), m.group(2)
        if name is not None:
            if not isinstance(data, dict) or name not in data:
                raise KeyError(f"{key!r}: no key {name!r}")
            data = data[name]
        elif inside.lstrip("-").isdigit():
            if not isinstance(data, list) or not -len(data) <= int(inside) < len(data):
                raise KeyError(f"{key!r}: no item [{inside}]")
            data = data[int(inside)]
        else:
            want = dict(part.split("=", 1) for part in inside.split(","))
            found = [
                item
                for item in (data if isinstance(data, list) else [])
                if isinstance(item, dict) and all(str(item.get(k)) == v for k, v in want.items())
            ]
            if len(found) != 1:
                raise KeyError(f"{key!r}: {len(found)} items match [{inside}], not one")
            data = found[0]
    return data


def _number(text: Any, where: str) -> float:
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        raise ClaimError(f"{where}: {text!r} is not a number") from None


def _read(claim: Claim) -> float:
    if not os.path.isfile(_path(claim.file)):
        raise ClaimError(f"{claim.id}: {claim.file} does not exist")
    where = f"{claim.id} ({claim.file})"
    if claim.key is not None:
        try:
            value = lookup(_load_json(claim.file), claim.key)
        except (KeyError, json.JSONDecodeError) as exc:
            raise ClaimError(f"{where}: {exc}") from None
    else:
        value = _text(claim.file)
    if claim.pattern is not None:
        m = re.search(claim.pattern, str(value))
        if m is None:
            raise ClaimError(f"{where}: no match for {claim.pattern!r}")
        value = m.group(1)
    return _number(value, where) * claim.scale


def values(claims: list[Claim | Ratio] | None = None) -> dict[str, float]:
    """Each claim's value, by id (ratios after the claims they divide)."""
    out: dict[str, float] = {}
    for claim in CLAIMS if claims is None else claims:
        if isinstance(claim, Ratio):
            for part in (claim.num, claim.den):
                if part not in out:
                    raise ClaimError(f"{claim.id}: {part} is not a claim declared before it")
            ratio = out[claim.num] / out[claim.den]
            out[claim.id] = ratio - 1 if claim.change else ratio
        else:
            out[claim.id] = _read(claim)
    return out


def figure(claim: Claim | Ratio, value: float) -> str:
    """The figure as the README writes it, without the unit."""
    return format(value, claim.fmt)


def files_of(claim: Claim | Ratio, by_id: dict[str, Claim | Ratio]) -> list[str]:
    """The result files a claim is read from (a ratio's: both of its parts')."""
    if isinstance(claim, Ratio):
        return sorted({f for part in (claim.num, claim.den) for f in files_of(by_id[part], by_id)})
    return [claim.file]


# Provenance.


def _recorded(rec: Recorded) -> str | None:
    if not os.path.isfile(_path(rec.file)):
        raise ClaimError(f"provenance: {rec.file} does not exist")
    text = re.sub(r"\\\n\s*", "", _text(rec.file))
    m = re.search(rec.pattern, text)
    if m is None:
        raise ClaimError(f"provenance: no match for {rec.pattern!r} in {rec.file}")
    return " ".join(m.group(1).split())


def _from_json(rel: str) -> dict[str, str]:
    try:
        data = _load_json(rel)
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict):
        return {}
    out = {}
    for scope in (data.get("provenance") if isinstance(data.get("provenance"), dict) else {}, data):
        for field, keys in _JSON_KEYS.items():
            for key in keys:
                value = scope.get(key)
                if field not in out and value not in (None, "", []):
                    out[field] = " ".join(value) if isinstance(value, list) else str(value)
    return out


def _from_env(text: str) -> dict[str, str]:
    """An environment file beside the results: ``NVIDIA <gpu>, <MiB>`` and ``torch <v> ...``
    lines, or one line ``<torch> <transformers> [<gpu>]``; ``commit <sha>`` anywhere."""
    out: dict[str, str] = {}
    first = text.split("\n", 1)[0].split()
    if len(first) >= 2 and _VERSION.match(first[0]) and _VERSION.match(first[1]):
        out["torch"] = first[0]
        if len(first) > 2 and first[2] == "NVIDIA":
            out["gpu"] = " ".join(first[2:])
    for key, regex in (("gpu", _GPU), ("torch", _TORCH), ("commit", re.compile(r"commit ([0-9a-f]{7,40})"))):
        m = regex.search(text)
        if key not in out and m:
            out[key] = m.group(1).strip()
    return out


def _from_text(text: str) -> dict[str, str]:
    out = {}
    for key, regex in (("gpu", _GPU), ("torch", _TORCH)):
        m = regex.search(text)
        if m:
            out[key] = m.group(1).strip()
    return out


def provenance(rel: str) -> dict[str, tuple[str, str] | None]:
    """Each field of :data:`FIELDS` for a result file: (value, where it is written), or None.

    In order: :data:`RECORDED`; the file's own keys (``commit``, ``device``, ``torch``,
    ``command``, also under ``provenance``); ``env.txt`` or ``device.txt`` beside it; for the GPU
    and torch, the file's own text, then the Markdown file of the same name; for the command, a
    ``Command: `...``` line in that Markdown file or in the folder's README.md."""
    folder = os.path.dirname(rel)
    stem = re.sub(r"\.json$", "", rel)
    found: dict[str, tuple[str, str] | None] = dict.fromkeys(FIELDS)

    def offer(where: str, fields: dict[str, str]) -> None:
        for field, value in fields.items():
            if field in found and found[field] is None and value:
                found[field] = (value, where)

    for field, rec in RECORDED.get(rel, {}).items():
        value = _recorded(rec)
        if value:
            found[field] = (value, os.path.relpath(rec.file, RESULTS))
    if rel.endswith(".json"):
        offer(f"{os.path.basename(rel)}, its keys", _from_json(rel))
    for name in ("env.txt", "device.txt"):
        env = f"{folder}/{name}"
        if os.path.isfile(_path(env)):
            offer(os.path.relpath(env, RESULTS), _from_env(_text(env)))
    offer(os.path.basename(rel), _from_text(_text(rel)))
    md = stem + ".md" if rel.endswith(".json") else None
    for doc in (md, f"{folder}/README.md"):
        if doc and os.path.isfile(_path(doc)):
            text = _text(doc)
            offer(os.path.relpath(doc, RESULTS), _from_text(text))
            m = _COMMAND.search(text)
            if m:
                offer(os.path.relpath(doc, RESULTS), {"command": " ".join(m.group(1).split())})
    return found


# INDEX.md.


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _link(rel: str) -> str:
    short = os.path.relpath(rel, RESULTS)
    return f"[{short}]({short})"


def render(claims: list[Claim | Ratio] | None = None) -> str:
    """INDEX.md's text."""
    claims = CLAIMS if claims is None else claims
    by_id = {c.id: c for c in claims}
    if len(by_id) != len(claims):
        raise ClaimError("two claims share an id")
    vals = values(claims)
    lines = [
        "# Results index",
        "",
        "<!-- Generated by `python benchmarks/results_index.py` from its CLAIMS; edit those, not this file.",
        "`python benchmarks/results_index.py --check` fails when this file is stale. -->",
        "",
        "Every figure of the README's measured-results table, read from the result file that backs it",
        "(`CLAIMS` in `benchmarks/results_index.py`). In README.md each figure is followed by",
        "`<!-- claim: ID -->`, and `tests/cpu/test_results_index.py` holds it equal to the figure here.",
        "Result folders whose figures later runs replaced are listed in [ARCHIVE.md](ARCHIVE.md).",
        "",
        "| claim | what | figure | file |",
        "|---|---|---|---|",
    ]
    for c in claims:
        shown = figure(c, vals[c.id]) + (f" {c.unit}" if c.unit not in ("", "x") else c.unit)
        if isinstance(c, Ratio):
            source = f"`{c.num}` / `{c.den}`" + (" - 1" if c.change else "")
        else:
            source = _link(c.file)
        label = c.label if c.quoted else f"{c.label} (not in the README: a ratio's part)"
        lines.append(f"| `{c.id}` | {_cell(label)} | {_cell(shown)} | {source} |")
    lines += [
        "",
        "## What each file records of its run",
        "",
        'Read from the file, or from a file beside it (named in brackets); "not recorded" where none says.',
    ]
    files = sorted({c.file for c in claims if isinstance(c, Claim)})
    for rel in files:
        used = ", ".join(f"`{c.id}`" for c in claims if isinstance(c, Claim) and c.file == rel)
        lines += ["", f"### {_link(rel)}", "", f"Claims: {used}.", ""]
        for field, got in provenance(rel).items():
            name = _FIELD_NAMES[field]
            if got is None:
                lines.append(f"- {name}: not recorded")
            else:
                value, where = got
                lines.append(f"- {name}: `{value}` ({where})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when INDEX.md is stale; write nothing")
    args = parser.parse_args(argv)
    try:
        text = render()
    except ClaimError as exc:
        print(f"results_index: {exc}", file=sys.stderr)
        return 1
    path = _path(INDEX)
    if args.check:
        current = open(path, encoding="utf-8").read() if os.path.isfile(path) else None
        if current != text:
            print(f"results_index: {INDEX} is stale; run python benchmarks/results_index.py", file=sys.stderr)
            return 1
        print(f"results_index: {INDEX} is up to date ({len(CLAIMS)} claims)")
        return 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"results_index: wrote {INDEX} ({len(CLAIMS)} claims)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
