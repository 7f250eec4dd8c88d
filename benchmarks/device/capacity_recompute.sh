#!/usr/bin/env bash
# Past the storage wall with the recompute placement (8B LoRA r=16), on one GPU:
# 1. the GPU tests of the recompute placement and of layer streaming;
# 2. the plan at this machine's budgets (rates measured) and its longest sequence;
# 3. the full-depth host and disk footprint at that length, run for real through the same
#    storage path (block inputs dropped, kept in pinned RAM or on disk) with the compute left
#    out (benchmarks/footprint.py), every restored or replayed block input checked;
# 4. the GPU side of that step at 3 layers: one kept input, one dropped and replayed, the
#    last on the GPU (the full plan's longest replayed run), its peak and time.
# Long: run it in the background (setsid) and read $OUT/progress.txt.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# The probe sets its features explicitly (no plan): segments that grow in place, as a planned run gets.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LAYERS=${LAYERS:-3}
start=$(date +%s)
say() { echo "$(( $(date +%s) - start )) s: $*" | tee -a "$OUT/progress.txt"; }
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" \
  > "$OUT/env.txt"
say "GPU tests"
timeout 300 python3 -m pytest -m gpu -q --timeout 240 -p no:cacheprovider -rfE tests/gpu/test_recompute_inputs_cuda.py \
  tests/gpu/test_layers_cuda.py > "$OUT/gpu_tests.txt" 2>&1
say "$(tail -1 "$OUT/gpu_tests.txt")"
python3 -m offloadkit plan --shape llama-3-8b --seq-len 1048576 --lora-rank 16 --measure > "$OUT/plan.txt" 2>&1
seq=$(grep -o "longest sequence that fits: [0-9]*" "$OUT/plan.txt" | grep -o "[0-9]*$")
say "plan: $(tail -1 "$OUT/plan.txt")"
[ -n "$seq" ] || { say "no longest sequence in the plan"; exit 1; }
timeout 600 python3 benchmarks/footprint.py --shape llama-3-8b --lora-rank 16 --seq-len "$seq" --out "$OUT" \
  > "$OUT/footprint.log" 2>&1
say "footprint exit $?: $(grep -o '"\(restored_inputs_exact\|step_s\|peak_rss_gib\|recomputed_inputs\|disk_fallbacks\)": [^,]*' "$OUT/footprint.log" | tr '\n' ' ')"
python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --budget-s 900 --out "$OUT" \
  --name capacity-recompute --probes "everything:$seq:$LAYERS:0:1" > "$OUT/capacity.log" 2>&1
say "probe: $(grep -v -i warn "$OUT/capacity.log" | grep "^everything\|^skip" | tail -2)"
say "done"
