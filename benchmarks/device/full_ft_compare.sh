#!/usr/bin/env bash
# On one GPU, the full fine-tune's measurements: BackwardAdamW's GPU tests; the loss curves of
# its three precisions (benchmarks/optimizer_precision.py, 200 steps); offloadkit against FSDP2
# CPUOffloadPolicy and DeepSpeed ZeRO-Offload with fp32 master weights at 16K, Llama-3.2-3B and
# Llama-3-8B shapes (benchmarks/full_ft_peers.py; DeepSpeed from .whl/deepspeed/, its CPU Adam
# built on first use); the full-depth host/disk footprint of the planner's longest 8B full
# fine-tune on this machine (benchmarks/footprint.py --lora-rank 0); the GPU side of the
# longest planned for an H100 with 128 GiB of RAM (79/108/55 GiB), 2 layers, timed.
# Results under $OUT; progress in $OUT/progress.txt. Longer than one command: start it with
# setsid and collect $OUT later.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log() { echo "$(date +%T) $*" | tee -a "$OUT/progress.txt"; }
STEPS=${STEPS:-"tests curve peers footprint longest"}
has() { [[ " $STEPS " == *" $1 "* ]]; }
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/env.txt"
free -g | tee -a "$OUT/env.txt"
if has tests; then
  log "== GPU tests (BackwardAdamW)"
  timeout 600 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/gpu/test_backward_adamw_cuda.py \
    > "$OUT/gpu-tests-backward-adamw.txt" 2>&1
  log "$(tail -1 "$OUT/gpu-tests-backward-adamw.txt")"
fi
if has curve; then
  log "== optimizer precision curves"
  timeout 900 python3 benchmarks/optimizer_precision.py --out "$OUT/precision" > "$OUT/precision.log" 2>&1
  log "rc=$? $(grep '^==' "$OUT/precision.log" | tr '\n' ' ')"
fi
if has peers; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-ds .whl/deepspeed/*.whl
  log "== peers at 16K"
  PYTHONPATH=$PYTHONPATH:/tmp/site-ds DS_BUILD_OPS=0 timeout 1500 python3 benchmarks/full_ft_peers.py --out "$OUT/peers" \
    --shapes "${PEER_SHAPES:-llama-3.2-3b,llama-3-8b}" > "$OUT/peers.log" 2>&1
  log "rc=$?"
fi
if has footprint; then
  log "== full-depth footprint, 8B full fine-tune at the planner's longest here"
  timeout 900 python3 benchmarks/footprint.py --shape llama-3-8b --lora-rank 0 --seq-len 0 --out "$OUT/footprint" \
    > "$OUT/footprint.log" 2>&1
  log "rc=$? $(grep -E '"(seq_len|peak_rss_gib|optimizer_state_host_gib|disk_written_gib|restored_inputs_exact|step_s)"' "$OUT/footprint.log" | tr -s ' \n' ' ')"
fi
if has longest; then
  log "== GPU side of the longest planned for 79/108/55 GiB, 2 layers"
  timeout 900 python3 benchmarks/full_ft_peers.py --out "$OUT/longest" --shapes llama-3-8b --modes offloadkit_plan \
    --seq-len 0 --layers 2 --budgets 79,108,55 --warmup 1 --steps 1 > "$OUT/longest.log" 2>&1
  log "rc=$?"
fi
log "== all done"
