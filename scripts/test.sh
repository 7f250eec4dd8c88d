#!/usr/bin/env bash
# The test suite: install what is needed, then run every test (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Lint and type-check first: both are fast, and a failure there is a real defect.
python -m ruff check offloadkit tests benchmarks scripts
python -m ruff format --check offloadkit tests benchmarks scripts
python -m mypy
exec python -m pytest -q "$@"
