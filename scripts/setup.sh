#!/usr/bin/env bash
# Create .venv (once) and install offloadkit with its extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  # Pin the CPU build explicitly: a looser spec would pull the CUDA wheels.
  python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
log=$(mktemp)
if ! python -m pip install -q -e ".[hf,yaml,plot,dev]" >"$log" 2>&1; then
  cat "$log"; rm -f "$log"; exit 1
fi
rm -f "$log"
