#!/usr/bin/env bash
# On one GPU: the GPU side of the planner's longest pure-bf16 8B full fine-tune for an H100
# with 128 GiB of RAM (budgets 79,108,55 GiB), at the depth that holds the full plan's peak
# (the last block's input on the GPU and the longest replayed run of blocks), with the GPU
# budget enforced. One step without warm-up. Results under $OUT/longest.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 benchmarks/full_ft_peers.py --out "$OUT/longest" --shapes llama-3-8b --modes offloadkit_plan --seq-len 0 \
  --layers 2 --budgets 79,108,55 --warmup "${WARMUP:-0}" --steps 1 2>&1 | grep -v -i warn | tail -3
