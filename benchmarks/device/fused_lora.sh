#!/usr/bin/env bash
# One GPU: the GPU tests of the fused LoRA path and of what a closed runtime gives back, then
# PEFT's LoRA path against fused_lora side by side (benchmarks/fused_lora.py) on the 8B LoRA
# r=16 at 2 layers with offload_plan: auto: 16K and 64K interleaved twice with a kernel-time
# breakdown, then 256K once. Results under $RESULTS (default $OUT): progress.txt,
# gpu_tests.txt, short/ and long/ (fused_lora.json, fused_lora.md).
source benchmarks/device/common.sh
RESULTS=${RESULTS:-$OUT}; mkdir -p "$RESULTS"
{ nvidia-smi -L; python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)"
  echo "commit ${OFFLOADKIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; } > "$RESULTS/env.txt"
say "GPU tests"
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/gpu/test_fused_lora_cuda.py \
  tests/gpu/test_release_cuda.py tests/gpu/test_full_ft_memory_cuda.py > "$RESULTS/gpu_tests.txt" 2>&1
say "$(tail -1 "$RESULTS/gpu_tests.txt")"
say "16K and 64K"
python3 benchmarks/fused_lora.py --seq-lens 16384,65536 --layers 2 --rounds 2 --kernel-breakdown \
  --out "$RESULTS/short" > "$RESULTS/short.log" 2>&1
say "$(tail -4 "$RESULTS/short.log")"
say "256K"
python3 benchmarks/fused_lora.py --seq-lens 262144 --layers 2 --rounds 1 --warmup 1 --steps 1 --kernel-breakdown \
  --out "$RESULTS/long" > "$RESULTS/long.log" 2>&1
say "$(tail -3 "$RESULTS/long.log")"
say "done"
