#!/usr/bin/env bash
# Create .venv (once) and install offloadkit with its extras. Idempotent: when .venv already
# has what pyproject.toml asks for, it says so in one line and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${TORCH_VERSION:-2.13.0}
# docs: mkdocs, its theme and mkdocstrings, for the documentation site scripts/test.sh builds.
EXTRAS=hf,yaml,plot,dev,docs
# What the last complete install was made from: pyproject.toml and the extras. A different
# stamp (or none) reinstalls offloadkit; torch is installed only when it cannot be imported.
STAMP=.venv/.offloadkit-setup
want="$(cat pyproject.toml) extras=$EXTRAS"

say() { echo "setup: $*" >&2; }

# Run "$@" quietly; print its output only if it fails. Say how long it took.
step() {
  local what=$1 start log
  shift
  say "$what ..."
  start=$SECONDS
  log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    say "$what failed"
    exit 1
  fi
  rm -f "$log"
  say "done in $((SECONDS - start)) s"
}

if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
  && .venv/bin/python -c "import torch, offloadkit" >/dev/null 2>&1; then
  say "using .venv (already set up)"
  exit 0
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" != "$want" ]; then
  say "pyproject.toml or the extras ($EXTRAS) changed since .venv was last set up: installing again"
fi
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PY" --version 2>&1)" "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  # Pin the CPU build explicitly: a looser spec would pull the CUDA wheels.
  step "installing torch $TORCH (CPU build) into .venv (about a minute)" python -m pip install -q "torch==$TORCH"
fi
step "installing offloadkit with extras ${EXTRAS//,/, } into .venv" python -m pip install -q -e ".[$EXTRAS]"
printf '%s' "$want" >"$STAMP"
