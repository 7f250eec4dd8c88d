# Sourced by the device scripts: strict pipes, the repository on PYTHONPATH, $OUT made, and
# say() (a line with the seconds since the start, also appended to $OUT/progress.txt).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
start=$(date +%s)
say() { echo "$(( $(date +%s) - start )) s: $*" | tee -a "$OUT/progress.txt"; }
# The capacity benchmark on the 8B LoRA r=16 the long-context results use.
cap() { python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 "$@"; }
