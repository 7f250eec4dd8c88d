#!/usr/bin/env bash
# The longest 8B LoRA step one 80 GB H100 holds, measured against the planner's physical limit:
# 1. the plan at this machine's budgets (rates measured) and its longest sequence;
# 2. that sequence's GPU peak and step time at 2 layers (the GPU holds the same at 32);
# 3. its full-depth host and disk footprint, run for real through the same storage path with
#    the compute left out (benchmarks/footprint.py), every restored block input checked.
# Results under $OUT: plan-edge.txt, capacity-edge.{md,json}, footprint-*.json.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
start=$(date +%s)
python3 -m offloadkit plan --shape llama-3-8b --seq-len 524288 --lora-rank 16 --measure > "$OUT/plan-edge.txt" 2>&1
tail -2 "$OUT/plan-edge.txt"
seq=$(grep -o "longest sequence that fits: [0-9]*" "$OUT/plan-edge.txt" | grep -o "[0-9]*$")
[ -n "$seq" ] || { echo "no longest sequence in the plan"; exit 1; }
echo "== GPU probe at $seq tokens, 2 layers, $(( $(date +%s) - start )) s in"
python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --budget-s 260 --out "$OUT" \
  --name capacity-edge --probes "everything:$seq:2:0:1" 2>&1 | grep -v -i warn | grep "^everything\|^skip\|^longest"
echo "== full-depth footprint at the planner's longest (budgets read again), $(( $(date +%s) - start )) s in"
timeout 300 python3 benchmarks/footprint.py --shape llama-3-8b --lora-rank 16 --seq-len 0 --out "$OUT" \
  > "$OUT/footprint.log" 2>&1; echo "footprint exit $?"; grep "Error" "$OUT/footprint.log" | tail -2
grep -v -i warn "$OUT/footprint.log" | grep '"\(seq_len\|fits\|placement\|step_s\|forward_s\|peak_rss_gib\|on_disk_after_forward_gib\|host_held_after_forward_gib\|restored_inputs_exact\|disk_fallbacks\|streamed_weights_host_gib\|host_budget_peak_gib\|host_budget_at_failure\|predicted\|host_gib\|disk_gib\|streamed_weights_gib\|disk_write_gb_s\|disk_read_gb_s\)"'
echo "== done in $(( $(date +%s) - start )) s"
