#!/usr/bin/env bash
# The default `offloadkit train` (no config), as a new user runs it, from the repository root.
#   OUT=/some/dir bash benchmarks/device/first_run.sh [NAME]     (NAME: gpu by default)
# Writes $OUT/NAME/: stdout.txt (the report), stderr.txt (the progress bar's last state,
# warnings), report.md, report.json, memory_timeline.png, device.txt. The model is not kept.
# The CPU results in benchmarks/results/first-run/cpu were made with
#   OUT=benchmarks/results/first-run PYTHON=.venv/bin/python bash benchmarks/device/first_run.sh cpu
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}; [ -e "$PY" ] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute, links kept (a venv)
OUT=${OUT:-/tmp/out}; DEST=$(realpath -m "$OUT/${1:-gpu}"); mkdir -p "$DEST"
RUN=$(mktemp -d)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || \
    echo "no GPU: $(nproc) CPU cores, $(free -g | awk '/Mem:/{print $2}') GiB RAM"
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$DEST/device.txt" 2>&1
start=$(date +%s.%N)
# From an empty directory, so that the report names the default output_dir as a user sees it.
(cd "$RUN" && "$PY" -m offloadkit train > "$DEST/stdout.txt" 2> "$RUN/stderr.raw")
rc=$?
end=$(date +%s.%N)
# The progress bar redraws with carriage returns: keep the last state of each line.
tr '\r' '\n' < "$RUN/stderr.raw" | awk '/^train: /{bar=$0; next} {if (bar != "") {print bar; bar=""}; print} END {if (bar != "") print bar}' > "$DEST/stderr.txt"
echo "exit code $rc, wall $("$PY" -c "print(f'{$end - $start:.1f}')") s" >> "$DEST/device.txt"
cp "$RUN/offloadkit-output/report.md" "$RUN/offloadkit-output/report.json" \
  "$RUN/offloadkit-output/memory_timeline.png" "$DEST/" 2>/dev/null
rm -rf "$RUN"
cat "$DEST/device.txt" "$DEST/stdout.txt"
exit $rc
