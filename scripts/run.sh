#!/usr/bin/env bash
# The main job: install what is needed, then fine-tune the built-in model with offloading
# (offloadkit train; pass a config file to change it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ "$#" -eq 0 ]; then
  # The built-in run into the default output_dir: running it again replaces the last one once
  # it has finished (a crash or Ctrl-C leaves the last one as it was).
  exec python -m offloadkit train --overwrite
fi
exec python -m offloadkit train "$@"
