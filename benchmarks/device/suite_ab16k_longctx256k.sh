#!/usr/bin/env bash
# After a change to the core, on one GPU: the whole GPU suite; the 16K rows A/B against a
# baseline tree BASE (1B full fine-tune: checkpointing, checkpoint-input offload, offload-all;
# 8B LoRA: checkpointing and everything on; benchmarks/device/ab_16k_rows.sh); then one
# full-depth 8B LoRA step at 256K tokens with everything on. About 20 minutes: run it in the
# background (setsid) and read $OUT/progress.txt.
#   bash benchmarks/device/suite_ab16k_longctx256k.sh BASE
set -uo pipefail
BASE=$1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
start=$(date +%s)
say() { echo "$(( $(date +%s) - start )) s: $*" | tee -a "$OUT/progress.txt"; }
say "GPU suite"
SUITE_TIMEOUT=${SUITE_TIMEOUT:-480} OUT=$OUT bash benchmarks/device/gpu_suite.sh > "$OUT/suite.log" 2>&1
say "$(tail -1 "$OUT/gpu_tests.txt")"
say "16K rows A/B"
OUT=$OUT/ab bash benchmarks/device/ab_16k_rows.sh "$BASE" > "$OUT/ab16k.log" 2>&1
say "$(grep -c . "$OUT/ab16k.log") lines"
say "256K full depth"
python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --budget-s 420 --out "$OUT" \
  --name longctx-256k-full-depth --probes "everything:262144:32:0:1" > "$OUT/capacity256k.log" 2>&1
say "probe: $(grep -v -i warn "$OUT/capacity256k.log" | grep "^everything\|^skip" | tail -2)"
say "done"
