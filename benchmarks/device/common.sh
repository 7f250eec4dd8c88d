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
MULTI="tests/gpu/test_distributed_updates_cuda.py tests/gpu/test_context_parallel_cuda.py"
deal_suite() {
  local files i
  mapfile -t files < <(for f in tests/gpu/test_*_cuda.py; do
    [[ " $MULTI " == *" $f "* ]] && continue; echo "$(grep -c 'def test' "$f") $f"; done | sort -rn | cut -d' ' -f2)
  groups=()
  for i in "${!files[@]}"; do groups[$(( i % $1 ))]="${groups[$(( i % $1 ))]:-} ${files[$i]}"; done
}
