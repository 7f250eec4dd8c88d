#!/usr/bin/env bash
# On one GPU, after the norm-output rebuild, the kept attention outputs, the attention head
# groups and the kept tail: their GPU tests; the 64K full-depth and 256K 2-layer 8B LoRA rows;
# the planner's longest 8B LoRA step for this machine's budgets at 3 layers (GPU side) and at
# full depth without the compute (host and disk side, benchmarks/footprint.py); the planned
# longest under enforced 16 and 24 GiB budgets; then the whole GPU suite. About 25 minutes:
# run it in the background (setsid) and read $OUT/progress.txt.
#   bash benchmarks/device/capacity_past_750k.sh
source benchmarks/device/common.sh
md5sum offloadkit/checkpointing/*.py offloadkit/longctx/*.py offloadkit/planning/*.py > "$OUT/tree.txt"
say "new GPU tests"
OUT=$OUT/new SUITE_TIMEOUT=300 bash benchmarks/device/gpu_suite.sh -s tests/gpu/test_kept_attention_cuda.py \
  tests/gpu/test_attention_groups_cuda.py tests/gpu/test_longctx_cuda.py > "$OUT/new.log" 2>&1
say "$(tail -1 "$OUT/new/gpu_tests.txt")"
say "rows"
python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --budget-s 400 --out "$OUT/rows" --name rows \
  --probes "everything:65536:32:1:2;everything:262144:2:1:2" > "$OUT/rows.log" 2>&1
say "$(grep -v -i warn "$OUT/rows.log" | grep "^everything" | tr '\n' ' ')"
SEQ=$(python3 -c "
from offloadkit.planning import Budgets, longest_sequence
c = longest_sequence('llama-3-8b', lora_rank=16, budgets=Budgets.detect())
print(c.longest)" 2>/dev/null | tail -1)
python3 -m offloadkit plan --shape llama-3-8b --lora-rank 16 --seq-len "$SEQ" > "$OUT/plan-longest.txt" 2>&1
say "edge: $SEQ tokens, $(tail -1 "$OUT/plan-longest.txt")"
python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --budget-s 560 --out "$OUT/edge" --name edge \
  --probes "everything:$SEQ:3:0:1" > "$OUT/edge.log" 2>&1
say "$(grep -v -i warn "$OUT/edge.log" | grep "^everything\|^skip" | tr '\n' ' ')"
say "footprint"
python3 benchmarks/footprint.py --shape llama-3-8b --lora-rank 16 --seq-len "$SEQ" --out "$OUT/footprint" \
  > "$OUT/footprint.log" 2>&1
say "$(tail -3 "$OUT/footprint.log" | tr '\n' ' ')"
for gib in 16 24; do
  say "enforced $gib GiB"
  python3 benchmarks/gpu_budget_probe.py --gpu-gib $gib --layers 2 --out "$OUT/budget" > "$OUT/budget-$gib.log" 2>&1
  say "$(tail -2 "$OUT/budget-$gib.log" | tr '\n' ' ')"
done
say "GPU suite"
SUITE_TIMEOUT=${SUITE_TIMEOUT:-560} OUT=$OUT bash benchmarks/device/gpu_suite.sh > "$OUT/suite.log" 2>&1
say "$(tail -1 "$OUT/gpu_tests.txt")"
say "done"
