# Sourced by the device scripts: strict pipes, the repository on PYTHONPATH, $OUT made, and
# say() (a line with the seconds since the start, also appended to $OUT/progress.txt).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
start=$(date +%s)
say() { echo "$(( $(date +%s) - start )) s: $*" | tee -a "$OUT/progress.txt"; }
# The capacity benchmark on the 8B LoRA r=16 the long-context results use.
cap() { python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 "$@"; }
# The tests that need two GPUs, and deal_suite N: the other GPU test files dealt round-robin,
# largest first, into groups[0..N-1] (one pytest per GPU).
MULTI="tests/gpu/test_distributed_updates_cuda.py tests/gpu/test_context_parallel_cuda.py tests/gpu/test_multinode_cuda.py"
deal_suite() {
  local files i
  mapfile -t files < <(for f in tests/gpu/test_*_cuda.py; do
    [[ " $MULTI " == *" $f "* ]] && continue; echo "$(grep -c 'def test' "$f") $f"; done | sort -rn | cut -d' ' -f2)
  groups=()
  for i in "${!files[@]}"; do groups[$(( i % $1 ))]="${groups[$(( i % $1 ))]:-} ${files[$i]}"; done
}
# The single-GPU suite over GPUs 0 and 1 at once, then the two-GPU tests on them; results in
# $OUT/gpu_tests_{0,1,multi}.txt.
suite_on_gpus_0_1() {
  local g
  deal_suite 2
  for g in 0 1; do
    CUDA_VISIBLE_DEVICES=$g timeout 330 python3 -m pytest -m gpu -q --timeout 240 -p no:cacheprovider -rfE \
      ${groups[$g]} > "$OUT/gpu_tests_$g.txt" 2>&1 &
  done; wait
  say "single-GPU suite: $(tail -1 "$OUT/gpu_tests_0.txt") | $(tail -1 "$OUT/gpu_tests_1.txt")"
  CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE $MULTI \
    > "$OUT/gpu_tests_multi.txt" 2>&1
  say "two GPUs: $(tail -1 "$OUT/gpu_tests_multi.txt")"
}
# The tests that need several GPUs: at two ranks on GPUs 0 and 1, then the four-rank ones on
# all four; results in $OUT/gpu_tests_{multi,four}.txt, failures appended to progress.txt.
several_gpu_tests_two() {
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE $MULTI \
    > "$OUT/gpu_tests_multi.txt" 2>&1
  say "two GPUs: $(tail -n 1 "$OUT/gpu_tests_multi.txt")"
}
several_gpu_tests_four() {
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE -k four $MULTI > "$OUT/gpu_tests_four.txt" 2>&1
  say "four GPUs: $(tail -n 1 "$OUT/gpu_tests_four.txt")"
  grep -hE "^(FAILED|ERROR)" "$OUT"/gpu_tests*.txt | tee -a "$OUT/progress.txt"
}
several_gpu_tests() { several_gpu_tests_two; several_gpu_tests_four; }
# A host of several GPUs: NVLink multicast off, $OUT/{cp,fsdp2} made, CAP the per-process
# GPU cap asked by GPU_GIB (79: an H100's memory on a larger card), and $OUT/env.txt with the
# versions, the cards, the host's RAM and the commit(s).
several_gpu_setup() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  mkdir -p "$OUT"/{cp,fsdp2}
  CAP=(); [[ -n ${GPU_GIB:-} ]] && CAP=(--gpu-gib "$GPU_GIB")
  { python3 -c "import torch, transformers, peft, accelerate; print(torch.__version__, transformers.__version__, peft.__version__, accelerate.__version__)"
    nvidia-smi -L; free -g | head -2; echo "commit ${OFFLOADKIT_COMMIT:-} before ${BEFORE_COMMIT:-}"; } > "$OUT/env.txt"
}
