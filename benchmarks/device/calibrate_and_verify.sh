#!/usr/bin/env bash
# On one GPU: the step-time calibration and the checks of the long-context changes.
#  1. the long-context GPU tests (kept attention, head groups, norm rebuild, measured rates);
#  2. `offloadkit plan --measure` at 256K (attention and layer-linear rates, copies, disk);
#  3. the 64K full-depth and 256K 2-layer rows, each with one more step profiled
#     (benchmarks/kernel_time.py: GPU time by kernel group, the compute stream's idle time);
#  4. the recompute placement against storage at one length: 256K x 4 layers, no input
#     dropped, then two dropped and replayed;
#  5. 256K at full depth after a warm-up step;
#  6. the whole GPU suite.
# About 25 minutes: run it in the background (setsid) and read $OUT/progress.txt.
#   bash benchmarks/device/calibrate_and_verify.sh
source benchmarks/device/common.sh
md5sum offloadkit/*/*.py benchmarks/*.py > "$OUT/tree.txt"
say "long-context GPU tests"
OUT=$OUT/new SUITE_TIMEOUT=300 bash benchmarks/device/gpu_suite.sh tests/gpu/test_kept_attention_cuda.py \
  tests/gpu/test_attention_groups_cuda.py tests/gpu/test_longctx_cuda.py tests/gpu/test_cli_cuda.py > "$OUT/new.log" 2>&1
say "$(tail -1 "$OUT/new/gpu_tests.txt")"
python3 -m offloadkit plan --shape llama-3-8b --lora-rank 16 --seq-len 262144 --measure > "$OUT/plan-262144.txt" 2>&1
say "plan: $(grep -i "rates\|measured" "$OUT/plan-262144.txt" | head -2 | tr '\n' ' ')"
cap --budget-s 400 --kernel-breakdown --out "$OUT/rows" --name rows \
  --probes "everything:65536:32:1:2;everything:262144:2:1:2" > "$OUT/rows.log" 2>&1
say "rows: $(grep -v -i warn "$OUT/rows.log" | grep "^everything" | tr '\n' ' ')"
for drops in 0 2; do
  cap --budget-s 240 --recompute-blocks $drops --kernel-breakdown --out "$OUT/replay" --name "replay-$drops" \
    --probes "everything:262144:4:1:1" > "$OUT/replay-$drops.log" 2>&1
  say "replay $drops: $(grep -v -i warn "$OUT/replay-$drops.log" | grep "^everything" | tr '\n' ' ')"
done
cap --budget-s 560 --out "$OUT/full" --name full-depth-256k --probes "everything:262144:32:1:1" > "$OUT/full.log" 2>&1
say "256K full depth: $(grep -v -i warn "$OUT/full.log" | grep "^everything\|^skip" | tr '\n' ' ')"
say "GPU suite"
SUITE_TIMEOUT=${SUITE_TIMEOUT:-560} OUT=$OUT bash benchmarks/device/gpu_suite.sh > "$OUT/suite.log" 2>&1
say "$(tail -1 "$OUT/gpu_tests.txt")"
say "done"
