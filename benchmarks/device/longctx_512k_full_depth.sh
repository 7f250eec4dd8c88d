#!/usr/bin/env bash
# One full-depth 8B LoRA (r=16) step at 524,288 tokens on one GPU, as `offload_plan: auto`
# plans it on this machine (block inputs in pinned RAM and on disk, weights streamed,
# chunked loss, tiled MLP), timed, beside the planner's prediction. About 15 minutes on an
# H100: run it in the background (setsid) and read $OUT/progress.txt; the result lands in
# $OUT/longctx-512k-full-depth.{json,md}.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SEQ=${SEQ:-524288}
start=$(date +%s)
say() { echo "$(( $(date +%s) - start )) s: $*" | tee -a "$OUT/progress.txt"; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2; df -h "${TMPDIR:-/tmp}" | tail -1
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} > "$OUT/env.txt" 2>&1
say "plan"
python3 -m offloadkit plan --shape llama-3-8b --seq-len "$SEQ" --lora-rank 16 --measure > "$OUT/plan-$SEQ.txt" 2>&1
say "$(grep -i "step time\|placement\|longest" "$OUT/plan-$SEQ.txt" | head -3 | tr '\n' ' ')"
say "step (32 layers, no warm-up: the first step also pins the host pool and selects kernels)"
python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --budget-s 1500 --out "$OUT" \
  --name longctx-512k-full-depth --probes "auto:$SEQ:32:0:1" > "$OUT/capacity.log" 2>&1
say "probe: $(grep -v -i warn "$OUT/capacity.log" | grep "^auto\|^skip" | tail -2)"
say "done"
