#!/usr/bin/env bash
# What the offloading machinery costs where a step fits without it (one H200, 141 GB):
# 8B LoRA, full depth, "everything" (block inputs offloaded, weights streamed) against
# "in_gpu" (the same checkpointing, chunked loss and tiling with nothing moved), at 32K and
# 64K, and Hugging Face checkpointing at 32K. Results under $OUT: machinery-h200.{md,json}.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/env.txt" 2>&1
PROBES="in_gpu:32768:32:1:2;everything:32768:32:1:2;in_gpu:65536:32:0:1;everything:65536:32:0:1"
PROBES+=";hf_ckpt:32768:32:1:2"
python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --budget-s "${BUDGET_S:-400}" --out "$OUT" \
  --name machinery-h200 --probes "$PROBES" 2>&1 | grep -v -i warn | grep "^in_gpu\|^everything\|^hf_ckpt\|^skip"
