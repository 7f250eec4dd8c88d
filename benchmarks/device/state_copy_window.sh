#!/usr/bin/env bash
# On one GPU: how BackwardAdamW's copy window (state fetched ahead and on its way back) trades
# against the activations' prefetches on the same host->device queue. Llama-3-8B shape, full
# fine-tune at 16K with checkpoint inputs offloaded and the chunked loss
# (benchmarks/full_ft_peers.py, mode offloadkit+chunked_loss), pure bf16 and fp32 master
# weights, for each window in WINDOWS (MiB): step time, the GPU's wait for activations, peaks.
# Results under $OUT/window-<precision>-<MiB>/; progress in $OUT/progress.txt.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for precision in ${PRECISIONS:-params fp32_master}; do
  for mib in ${WINDOWS:-1024 256 64}; do
    timeout 600 python3 benchmarks/full_ft_peers.py --out "$OUT/window-$precision-$mib" --shapes "${SHAPE:-llama-3-8b}" \
      --modes offloadkit+chunked_loss --ours-params --precision "$precision" --copy-window-mib "$mib" \
      > "$OUT/window-$precision-$mib.log" 2>&1
    echo "$(date +%T) $precision $mib MiB rc=$? $(grep -o '"step_s": [0-9.]*\|"activation_wait_s": [0-9.]*\|"peak_allocated_gib": [0-9.]*' \
      "$OUT/window-$precision-$mib.log" | tr '\n' ' ')" | tee -a "$OUT/progress.txt"
  done
done
echo "== all done" | tee -a "$OUT/progress.txt"
