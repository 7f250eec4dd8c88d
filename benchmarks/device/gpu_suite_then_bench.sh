#!/usr/bin/env bash
# On a GPU machine: environment facts, the GPU test suite, then the given benchmarks.
# Usage: bash benchmarks/device/gpu_suite_then_bench.sh [tests] [bench-args ...]
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 - <<'PY' | tee "$OUT/env.txt"
import torch, platform, psutil
print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())
print("device", torch.cuda.get_device_name(), "host RAM GiB", round(psutil.virtual_memory().total / 2**30, 1))
rt = torch.cuda.cudart()
print("cudart host register:", hasattr(rt, "cudaHostRegister"), "getLastError:", hasattr(rt, "cudaGetLastError"))
for name in ("transformers", "peft", "accelerate", "trl"):
    try:
        m = __import__(name); print(name, m.__version__)
    except Exception as e:
        print(name, "missing", type(e).__name__)
PY
