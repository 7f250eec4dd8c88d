#!/usr/bin/env bash
# On one GPU (written for the H200): the calibrated step-time model and the planner's longest.
#  1. SDPA's default kernel with contiguous and projection-layout inputs, whole and over head
#     groups (benchmarks/attention_kernels.py --layouts), and the GPU tests of the rates;
#  2. `offloadkit plan --measure` at the planner's longest for this machine's budgets;
#  3. the 64K full-depth and 256K 2-layer rows, each with one more step profiled;
#  4. the planner's longest at reduced depth: the last input and its longest replayed run
#     (GPU side), then at full depth without the compute (host and disk side).
# About 13 minutes on an H100: run it in the background (setsid) and read $OUT/progress.txt.
# SKIP="layouts tests rows footprint" leaves those steps out; EDGE_LAYERS=N probes the edge at N
# layers instead of the last input and its longest replayed run.
#   bash benchmarks/device/calibrated_longest.sh
source benchmarks/device/common.sh
want() { [[ " ${SKIP:-} " != *" $1 "* ]]; }
md5sum offloadkit/*/*.py benchmarks/*.py > "$OUT/tree.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" \
  > "$OUT/env.txt"
if want layouts; then
  say "attention layouts"
  python3 benchmarks/attention_kernels.py --layouts --seq 65536,262144 --repeats 2 --out "$OUT/attention" \
    > "$OUT/attention.log" 2>&1
  say "$(python3 -c "
import json; rows = json.load(open('$OUT/attention/attention-layouts.json'))['rows']
print('; '.join(f\"{r['seq']} {r['layout']} g{r['groups']}: fwd {r.get('forward_tflops')} bwd {r.get('backward_tflops')}\" for r in rows))")"
fi
if want tests; then
  timeout 300 python3 -m pytest -m gpu -q --timeout 240 -p no:cacheprovider -rfE tests/gpu/test_cli_cuda.py \
    tests/gpu/test_attention_groups_cuda.py > "$OUT/gpu_tests.txt" 2>&1
  say "GPU tests: $(tail -1 "$OUT/gpu_tests.txt")"
fi
read -r SEQ LAYERS < <(python3 -c "
from offloadkit.planning import Budgets, longest_sequence, plan, resolve_shape
from offloadkit.planning.memory import region_length
b = Budgets.detect().measure(shape=resolve_shape('llama-3-8b'), lora_rank=16)
seq = longest_sequence('llama-3-8b', lora_rank=16, budgets=b).longest
print(seq, region_length(plan('llama-3-8b', seq, lora_rank=16, budgets=b).memory.block_placement) + 1)" 2>/dev/null | tail -1)
python3 -m offloadkit plan --shape llama-3-8b --lora-rank 16 --seq-len "$SEQ" --measure > "$OUT/plan-longest.txt" 2>&1
say "longest $SEQ tokens, probe depth $LAYERS: $(grep "rates\|longest" "$OUT/plan-longest.txt" | tr '\n' ' ')"
if want rows; then
  cap --budget-s 400 --kernel-breakdown --out "$OUT/rows" --name rows \
    --probes "everything:65536:32:1:2;everything:262144:2:1:2" > "$OUT/rows.log" 2>&1
  say "rows: $(grep -v -i warn "$OUT/rows.log" | grep "^everything" | tr '\n' ' ')"
fi
LAYERS=${EDGE_LAYERS:-$LAYERS}
# The probe sets its features itself: segments that grow in place, as a planned run gets.
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cap --budget-s 1200 --out "$OUT/edge" --name "edge-$SEQ" \
  --probes "everything:$SEQ:$LAYERS:0:1" > "$OUT/edge.log" 2>&1
say "edge: $(grep -v -i warn "$OUT/edge.log" | grep "^everything\|^skip" | tr '\n' ' ')"
if want footprint; then
  timeout 600 python3 benchmarks/footprint.py --shape llama-3-8b --lora-rank 16 --seq-len "$SEQ" \
    --out "$OUT/footprint" > "$OUT/footprint.log" 2>&1
  say "footprint exit $?: $(grep -o '"\(restored_inputs_exact\|peak_rss_gib\|recomputed_inputs\|disk_fallbacks\|disk_gib\)": [^,]*' "$OUT/footprint.log" | tr '\n' ' ')"
fi
say "done"
