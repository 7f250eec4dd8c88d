#!/usr/bin/env bash
# On one GPU: the compatibility matrix (benchmarks/compat.py), with wheels from .whl/
# (bitsandbytes for the QLoRA row) installed first when .whl/ is present. Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
timeout "${COMPAT_TIMEOUT:-540}" python3 benchmarks/compat.py --out "$OUT" "$@" 2>&1 | grep -v "Warning\|warn(" \
  | tee "$OUT/compat.log" | grep "^==\|failed\|DIFFERS"
tail -60 "$OUT/compat.md"
