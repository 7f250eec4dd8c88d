#!/usr/bin/env bash
# Past 512K on one 80 GB H100, under 9 minutes: the GPU suite, then 8B LoRA probes at
# reduced depth (2 layers: the GPU peak does not depend on depth) at the planner's longest
# sequence with PyTorch's default allocator, and at 672K with expandable segments
# (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which reserves close to what is
# allocated. Results under $OUT: gpu_tests.txt, capacity-limit-default.*, capacity-limit-expandable.*.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
start=$(date +%s)
echo "== GPU suite"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.txt" 2>&1
tail -4 "$OUT/gpu_tests.txt"
echo "== default allocator, $(( $(date +%s) - start )) s in"
python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --budget-s 170 --out "$OUT" \
  --name capacity-limit-default --probes "everything:622592:2:0:1" 2>&1 | grep -v -i warn | grep "^everything\|^skip"
echo "== expandable segments, $(( $(date +%s) - start )) s in"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 \
  --budget-s 190 --out "$OUT" --name capacity-limit-expandable \
  --probes "everything:688128:2:0:1" 2>&1 | grep -v -i warn | grep "^everything\|^skip"
echo "== done in $(( $(date +%s) - start )) s"
