#!/usr/bin/env bash
# On one H100, liger-kernel under /tmp/site (carried as a wheel): the Liger GPU tests and the
# tiled-norm rebuild test with and without liger-kernel importable; then the 8B LoRA r=16,
# offload_plan: auto, at 64K full depth without liger-kernel (auto leaves the layers eager) and
# with it, interleaved, and at 256K over 2 layers with it. Results under $OUT. Run from .snap.
. "$(dirname "$0")/common.sh"
{ python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
  PYTHONPATH=/tmp/site:$PWD python3 -c "import importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))"
  nvidia-smi -L | head -1; echo "commit ${OFFLOADKIT_COMMIT:-}"; } | tee "$OUT/env.txt"
REBUILD=tests/gpu/test_longctx_cuda.py::test_rebuilt_norm_outputs_bitwise_on_cuda
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -m gpu -q --timeout 150 -p no:cacheprovider -rfE \
  tests/gpu/test_liger_kernels_cuda.py $REBUILD > "$OUT/gpu_tests_liger.txt" 2>&1
say "with liger-kernel: $(tail -n 1 "$OUT/gpu_tests_liger.txt")"
timeout 60 python3 -m pytest -m gpu -q --timeout 50 -p no:cacheprovider -rfE $REBUILD > "$OUT/gpu_tests_plain.txt" 2>&1
say "without: $(tail -n 1 "$OUT/gpu_tests_plain.txt")"
run() {  # run NAME PROBE with|without
  local path=$PWD; [ "$3" = with ] && path=/tmp/site:$PWD
  PYTHONPATH=$path timeout 260 python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 \
    --probes "$2" --budget-s 250 --out "$OUT/rows" --name "$1" 2>&1 | grep -E "^\| auto" | tail -1
  say "$1"
}
run auto-65536-32L-eager "auto:65536:32:1:2" without
run auto-65536-32L-liger "auto:65536:32:1:2" with
run auto-262144-2L-liger "auto:262144:2:1:2" with
say "done"
