#!/usr/bin/env bash
# After the norm-output rebuild and the kept attention outputs, on one GPU: their GPU tests
# first, then the whole GPU suite; the 64K full-depth and 256K 2-layer 8B LoRA probes in a
# baseline tree BASE and in this one; then what is alive at the peak of a 256K 2-layer step
# and of a 753,664-token 3-layer step. About 25 minutes: run it in the background (setsid)
# and read $OUT/progress.txt.
#   bash benchmarks/device/kept_attention_and_peaks.sh BASE
source benchmarks/device/common.sh
BASE=$1
md5sum offloadkit/checkpointing/*.py offloadkit/longctx/*.py offloadkit/runtime/*.py > "$OUT/tree.txt"
say "new GPU tests"
OUT=$OUT/new SUITE_TIMEOUT=300 bash benchmarks/device/gpu_suite.sh tests/gpu/test_kept_attention_cuda.py \
  tests/gpu/test_longctx_cuda.py > "$OUT/new.log" 2>&1
say "$(tail -1 "$OUT/new/gpu_tests.txt")"
say "GPU suite"
SUITE_TIMEOUT=${SUITE_TIMEOUT:-560} OUT=$OUT bash benchmarks/device/gpu_suite.sh > "$OUT/suite.log" 2>&1
say "$(tail -1 "$OUT/gpu_tests.txt")"
PROBES="everything:65536:32:1:2;everything:262144:2:1:2"
for tree in base this; do
  say "probes, $tree"
  dir=$PWD; [ "$tree" = base ] && dir=$BASE
  (cd "$dir" && PYTHONPATH=$dir python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --budget-s 400 \
    --out "$OUT/$tree" --name probes --probes "$PROBES" > "$OUT/$tree.log" 2>&1)
  say "$(grep -v -i warn "$OUT/$tree.log" | grep "^everything" | tr '\n' ' ')"
done
say "peak breakdowns"
python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --budget-s 420 --out "$OUT/breakdown" \
  --name breakdown --peak-breakdown --probes "everything:262144:2:1:2;everything:753664:3:0:2" > "$OUT/breakdown.log" 2>&1
say "$(grep -v -i warn "$OUT/breakdown.log" | grep "^everything" | tr '\n' ' ')"
say "done"
