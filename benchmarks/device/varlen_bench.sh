#!/usr/bin/env bash
# On a GPU machine: the whole GPU suite, then the variable-length benchmark. Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
timeout 330 python3 -m pytest -m gpu -q --timeout 200 -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
timeout 200 python3 benchmarks/varlen.py --steps 50 --out "$OUT" 2>&1 | grep -v Warning | tail -20
