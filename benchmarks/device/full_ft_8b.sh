#!/usr/bin/env bash
# On one GPU: full fine-tunes of the Llama-3-8B shape with BackwardAdamW through
# `offloadkit train` (benchmarks/configs/full-ft-8b-16k.yaml, one sequence a step): pure bf16
# at 16K for 20 steps, fp32 master weights and moments (optimizer_precision: fp32_master) at
# 16K for 20 steps, pure bf16 at 64K for 3 steps (the shipped text repeated to fill 64K); the
# streamed-* runs add layer_offloading (the layers' trainable weights in pinned host memory,
# updated in backward while resident); streamed-clip-16k clips (every update deferred to step(),
# through the GPU's mapping of the host copies); auto-16gib-32k lets the planner fit 32K
# tokens under an enforced 16 GiB GPU budget.
# Each run's report (step times, peaks, host RAM) and log under $OUT. Longer than one command:
# start it with setsid and collect $OUT later.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "
from offloadkit.data import load_texts
open('/tmp/corpus-x6.txt', 'w').write(load_texts()[0] * 6)"
run() {  # name, extra config lines
  local name=$1; shift
  local keys="output_dir"
  for line in "$@"; do keys="$keys|${line%%:*}"; done
  { grep -v -E "^($keys):" benchmarks/configs/full-ft-8b-16k.yaml; printf '%s\n' "$@"; echo "output_dir: /tmp/ft-$name"; } \
    > "$OUT/$name.yaml"
  /usr/bin/time -v python3 -m offloadkit train "$OUT/$name.yaml" --overwrite > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"
  cp /tmp/ft-"$name"/report.json "$OUT/$name-report.json" 2>/dev/null
  cp /tmp/ft-"$name"/report.md "$OUT/$name-report.md" 2>/dev/null
  rm -rf /tmp/ft-"$name"
  grep -E "training |peak GPU|Maximum resident|Error" "$OUT/$name.log" | tail -6
}
RUNS=${RUNS:-"bf16-16k fp32-master-16k bf16-64k"}  # a subset: RUNS="bf16-16k"
[[ " $RUNS " == *" bf16-16k "* ]] && run bf16-16k
[[ " $RUNS " == *" fp32-master-16k "* ]] && run fp32-master-16k "optimizer_precision: fp32_master"
[[ " $RUNS " == *" bf16-64k "* ]] && run bf16-64k "seq_len: 65536" "max_steps: 3" "dataset: /tmp/corpus-x6.txt"
[[ " $RUNS " == *" streamed-bf16-16k "* ]] && run streamed-bf16-16k "layer_offloading: true"
[[ " $RUNS " == *" streamed-fp32-master-16k "* ]] && run streamed-fp32-master-16k "layer_offloading: true" \
  "optimizer_precision: fp32_master"
[[ " $RUNS " == *" streamed-bf16-64k "* ]] && run streamed-bf16-64k "layer_offloading: true" "seq_len: 65536" \
  "max_steps: 3" "dataset: /tmp/corpus-x6.txt"
[[ " $RUNS " == *" streamed-clip-16k "* ]] && run streamed-clip-16k "layer_offloading: true" "max_grad_norm: 1.0" \
  "max_steps: 5"
[[ " $RUNS " == *" auto-16gib-32k "* ]] && run auto-16gib-32k "offload_plan: auto" "gpu_budget_bytes: 16GiB" \
  "seq_len: 32768" "max_steps: 3" "dataset: /tmp/corpus-x6.txt"
echo "== all done"
