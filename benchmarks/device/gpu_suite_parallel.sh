#!/usr/bin/env bash
# The whole single-GPU suite split over every GPU of the host (one pytest per GPU, test files
# dealt out round-robin, largest first), then the tests that need two GPUs. Results under $OUT:
# gpu_tests_<i>.txt per GPU, gpu_tests_multi.txt, env.txt.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
GPUS=$(nvidia-smi -L | wc -l)
{ python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
  python3 -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" 2>&1 | tail -1
  nvidia-smi -L; echo "commit ${OFFLOADKIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; } | tee "$OUT/env.txt"
MULTI="tests/gpu/test_distributed_updates_cuda.py tests/gpu/test_context_parallel_cuda.py tests/gpu/test_multinode_cuda.py"
mapfile -t files < <(for f in tests/gpu/test_*_cuda.py; do
  [[ " $MULTI " == *" $f "* ]] && continue; echo "$(grep -c 'def test' "$f") $f"; done | sort -rn | cut -d' ' -f2)
declare -a groups
for i in "${!files[@]}"; do g=$(( i % GPUS )); groups[$g]="${groups[$g]:-} ${files[$i]}"; done
start=$(date +%s)
for g in $(seq 0 $(( GPUS - 1 ))); do
  CUDA_VISIBLE_DEVICES=$g timeout "${SUITE_TIMEOUT:-540}" python3 -m pytest -m gpu -q --timeout 300 \
    -p no:cacheprovider -rfE ${groups[$g]} > "$OUT/gpu_tests_$g.txt" 2>&1 &
done
wait
for g in $(seq 0 $(( GPUS - 1 ))); do echo "GPU $g: $(tail -1 "$OUT/gpu_tests_$g.txt")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_$g.txt"; done
echo "== single-GPU suite in $(( $(date +%s) - start )) s"
if (( GPUS > 1 )); then
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE $MULTI > "$OUT/gpu_tests_multi.txt" 2>&1
  echo "two GPUs: $(tail -1 "$OUT/gpu_tests_multi.txt")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_multi.txt"
fi
echo "== done in $(( $(date +%s) - start )) s"
