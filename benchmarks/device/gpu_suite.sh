#!/usr/bin/env bash
# On one GPU: the whole GPU suite, with wheels from .whl/ (bitsandbytes for the QLoRA tests;
# trl, datasets, dill, multiprocess for the TRL trainer tests)
# installed first when .whl/ is present. Results under $OUT (gpu_tests.txt, env.txt).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/env.txt"
python3 -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" 2>&1 | tail -1 | tee -a "$OUT/env.txt"
start=$(date +%s)
timeout "${SUITE_TIMEOUT:-520}" python3 -m pytest -m gpu -q --timeout 300 -p no:cacheprovider -rfE "${@:-tests/gpu}" \
  > "$OUT/gpu_tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -15
echo "== done in $(( $(date +%s) - start )) s"
