#!/usr/bin/env bash
# GPU suite + checkpoint-input offloading / layer streaming benchmark (8B LoRA), results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -m gpu -q --timeout 300 -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
python3 benchmarks/bench_offload.py --shape llama-3-8b --lora-rank 16 --out "$OUT" --name llama-3-8b-lora-16k-layers \
  --modes "ckpt;ok_ckpt;ckpt+input_offload;ckpt+layer_stream;ckpt+input_offload+layer_stream;ckpt+input_offload+layer_stream@stream_depth=3" 2>&1 | grep -v Warning | tail -12
python3 benchmarks/bench_offload.py --shape llama-3.2-1b --out "$OUT" --name llama-3.2-1b-16k-recheck \
  --modes "ckpt;ckpt+offload;offload" 2>&1 | grep -v Warning | tail -6
