#!/usr/bin/env bash
# Raw disk bandwidth, the whole GPU suite, and the disk-tier benchmark. Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SPILL=${SPILL:-/tmp/offloadkit-bench}; mkdir -p "$SPILL"
{ df -h "$SPILL"; echo "write:"; dd if=/dev/zero of="$SPILL/dd.bin" bs=16M count=256 oflag=direct 2>&1 | tail -1
  echo "read:"; dd if="$SPILL/dd.bin" of=/dev/null bs=16M iflag=direct 2>&1 | tail -1; rm -f "$SPILL/dd.bin"; } | tee "$OUT/disk_raw.txt"
python3 -m pytest -m gpu -q --timeout 400 -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt" | tail -6
python3 benchmarks/bench_offload.py --shape llama-3-8b --lora-rank 16 --out "$OUT" --name llama-3-8b-lora-16k-disk \
  --disk-dir "$SPILL" --modes "ckpt;ckpt+input_offload;ckpt+input_offload@storage=disk;ckpt+input_offload@storage=tiered,host_budget_gib=2" \
  2>&1 | grep -v Warning | tail -8
