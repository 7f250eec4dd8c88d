#!/usr/bin/env bash
# On one GPU: the whole GPU suite, then the trainer cells of the compatibility matrix
# (benchmarks/compat_trainers.py: TRL, PEFT variants, the Trainer's loops), then DeepSpeed
# ZeRO-2/3 through the Trainer (benchmarks/deepspeed_probe.py, with the wheels in
# .whl/deepspeed/, installed apart so the other runs do not see DeepSpeed). Results under $OUT.
# Longer than one command: start it with setsid and collect $OUT later.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SUITE_TIMEOUT=${SUITE_TIMEOUT:-900} bash benchmarks/device/gpu_suite.sh "$@"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
echo "== trainer cells"
timeout 900 python3 benchmarks/compat_trainers.py --out "$OUT" > "$OUT/compat-trainers.log" 2>&1
grep "^==\|failed\|DIFFERS" "$OUT/compat-trainers.log"
if ls .whl/deepspeed/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-ds .whl/deepspeed/*.whl
  echo "== deepspeed"
  PYTHONPATH=$PYTHONPATH:/tmp/site-ds DS_BUILD_OPS=0 timeout 900 python3 benchmarks/deepspeed_probe.py --out "$OUT" ${DS_ARGS:-} \
    > "$OUT/deepspeed.log" 2>&1
  tail -4 "$OUT/deepspeed.log"
  echo "== deepspeed GPU tests"
  PYTHONPATH=$PYTHONPATH:/tmp/site-ds timeout 900 python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/gpu/test_deepspeed_cuda.py > "$OUT/gpu_tests_deepspeed.txt" 2>&1
  tail -1 "$OUT/gpu_tests_deepspeed.txt"
fi
echo "== all done"
