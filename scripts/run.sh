#!/usr/bin/env bash
# The main job: install what is needed, then run the offloadkit demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m offloadkit demo "$@"
