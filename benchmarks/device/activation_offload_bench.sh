#!/usr/bin/env bash
# GPU suite + activation-offloading benchmarks (1B full fine-tune, 8B LoRA), results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -m gpu -q --timeout 300 -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
python3 benchmarks/bench_offload.py --shape llama-3.2-1b --out "$OUT" --name llama-3.2-1b-16k \
  --modes "none;ckpt;ckpt+offload;ckpt+offload@prefetch=1;ckpt+offload@prefetch=4;offload;offload@prefetch_bytes=1g;offload@prefetch_bytes=4g;ckpt+save_on_cpu;save_on_cpu" 2>&1 | grep -v Warning | tail -14
python3 benchmarks/bench_offload.py --shape llama-3-8b --lora-rank 16 --out "$OUT" --name llama-3-8b-lora-16k \
  --modes "none;ckpt;ckpt+offload;ckpt+offload@prefetch=1;ckpt+offload@prefetch=4;offload;ckpt+save_on_cpu;save_on_cpu" 2>&1 | grep -v Warning | tail -12
