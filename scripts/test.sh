#!/usr/bin/env bash
# The test suite: install what is needed, then run every test (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q "$@"
