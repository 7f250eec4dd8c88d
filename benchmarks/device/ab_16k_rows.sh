#!/usr/bin/env bash
# Two trees on one GPU, interleaved: the 16K rows (1B full fine-tune: checkpointing,
# checkpoint-input offload, offload-all; 8B LoRA: checkpointing and everything on), first in
# the baseline tree BASE (a copy of an earlier commit's offloadkit/ and benchmarks/), then in
# this one, shape by shape. Results under $OUT/base and $OUT/this.
#   bash benchmarks/device/ab_16k_rows.sh BASE
set -uo pipefail
BASE=$1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/base" "$OUT/this"
export PYTHONUNBUFFERED=1
run() {  # run TREE NAME SHAPE ARGS...
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH=$PWD python3 benchmarks/bench_offload.py "$@" --steps 6 --warmup 2 \
     --out "$OUT/$name" 2>&1 | grep -v "Warning\|warn(" | tail -5)
}
for tree in "$BASE:base" "$PWD:this"; do
  run "${tree%%:*}" "${tree##*:}" --shape llama-3.2-1b --name llama-3.2-1b-16k --modes "ckpt;ckpt+input_offload;offload"
done
for tree in "$BASE:base" "$PWD:this"; do
  run "${tree%%:*}" "${tree##*:}" --shape llama-3-8b --lora-rank 16 --name llama-3-8b-lora-16k \
    --modes "ckpt;ckpt+input_offload+layer_stream"
done
