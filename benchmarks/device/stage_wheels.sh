#!/usr/bin/env bash
# Stage, on a machine with internet, the wheels a GPU machine without it needs for
# compute_rows_h100.sh, in carries of at most 64 MiB each (the tracked tree travels too):
#   .whl/fa4a, .whl/fa4b  FlashAttention-4 and its CuTe DSL (nvidia-cutlass-dsl 4.8.1: the
#                         package, its -libs-core (the Python `cutlass` package), -libs-base and
#                         the cu13 runtime, the last split in two parts over both folders);
#                         fa4b/opt holds dependencies installed only where the machine lacks them
#   .whl/axolotl          Axolotl 0.19 and what it needs beyond the machine's image
#   .whl/liger_kernel-*.whl
#   .snap_before          the package and benchmarks of BEFORE_COMMIT (rows before and after)
# Usage: BEFORE_COMMIT=3dddea8 bash benchmarks/device/stage_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
get() { python3 -m pip download -q --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --only-binary=:all: -d "$@"; }
tmp=$(mktemp -d)
mkdir -p .whl/fa4a .whl/fa4b/opt .whl/axolotl
get .whl/fa4a flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext "quack-kernels>=0.5.3" einops
get .whl/fa4b nvidia-cutlass-dsl-libs-base==4.8.1
get .whl/fa4b/opt "cuda-bindings>=13,<14" cuda-pathfinder protobuf
get "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
split -n 2 "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl "$tmp/cu13.part."
mv "$tmp/cu13.part.aa" .whl/fa4a/ && mv "$tmp/cu13.part.ab" .whl/fa4b/
get .whl liger-kernel==0.8.5
get .whl/axolotl axolotl==0.19.0 trl==1.9.0 datasets==4.8.4 addict "dill==0.4.1" "multiprocess==0.70.19"
if [ -n "${BEFORE_COMMIT:-}" ]; then
  rm -rf .snap_before && mkdir -p .snap_before
  git archive "$BEFORE_COMMIT" offloadkit $(git ls-tree --name-only "$BEFORE_COMMIT" benchmarks/ | grep '\.py$') \
    | tar -x -C .snap_before
fi
rm -rf "$tmp"
du -sh .whl/* .snap_before 2>/dev/null
