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
# The documentation site (mkdocs.yml), warnings as errors: a broken link or anchor, or a page
# left out of the nav, fails here (about 2 s). Its output only on failure; not with -q, under
# which mkdocs neither shows nor counts its warnings.
log=$(mktemp)
if ! NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --clean >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  echo "test: the documentation site did not build (mkdocs build --strict)" >&2
  exit 1
fi
rm -f "$log"
echo "test: documentation site built into site/ (mkdocs build --strict)" >&2
# Without a GPU: two workers (one per core of the CI machine), one torch thread each, so the
# CPU suite takes about 9.5 minutes instead of 14. With a GPU: one process, since GPU tests
# measure memory and time and must not share the device. The slowest tests are listed last.
workers=${PYTEST_WORKERS:-$(python -c "import torch; print(0 if torch.cuda.is_available() else 2)")}
if [ "$workers" != 0 ]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
exec python -m pytest -q -n "$workers" --durations=10 "$@"
