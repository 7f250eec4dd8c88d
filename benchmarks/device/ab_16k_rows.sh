#!/usr/bin/env bash
# Two trees on one GPU, interleaved: the 16K rows (1B full fine-tune: checkpointing,
# checkpoint-input offload, offload-all; 8B LoRA: checkpointing, checkpoint-input offload with
# layer streaming, and everything on: those two plus the chunked loss and tiled MLP, through
# benchmarks/capacity.py's probes against Hugging Face checkpointing), first in
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
for tree in "$BASE:base" "$PWD:this"; do
  (cd "${tree%%:*}" && PYTHONPATH=$PWD python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 \
     --budget-s 400 --out "$OUT/${tree##*:}" --name llama-3-8b-lora-16k-everything \
     --probes "hf_ckpt:16384:32:1:3;everything:16384:32:1:3" 2>&1 | grep -v -i warn | tail -4)
done
