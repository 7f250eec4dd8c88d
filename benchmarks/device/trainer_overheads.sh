#!/usr/bin/env bash
# On one GPU: benchmarks/trainer_overheads.py with PyTorch's default allocator and with
# expandable segments (the full fine-tune cases), then the reentrant rounds. Results under $OUT.
. "$(dirname "$0")/common.sh"
CASES=${CASES:-fullft-plain,fullft-prepare,fullft-train}
say "full fine-tune, default allocator"
python3 benchmarks/trainer_overheads.py --out "$OUT" --cases "$CASES" --tag=-default 2>&1 | cut -c1-600
say "full fine-tune, expandable segments"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benchmarks/trainer_overheads.py --out "$OUT" \
  --cases "$CASES" --tag=-expandable 2>&1 | cut -c1-600
if [ "${REENTRANT:-1}" = 1 ]; then
  say "reentrant rounds"
  python3 benchmarks/trainer_overheads.py --out "$OUT" --cases reentrant --tag=-reentrant 2>&1 | cut -c1-600
fi
say "done"
