#!/usr/bin/env bash
# On one GPU: the whole GPU suite (context parallelism included: two ranks share the GPU over
# gloo), TRL's and torchtune's offloading tests against offloadkit when their ports are
# present in .ext/ (not part of the repository), FSDP2 on one rank (benchmarks/fsdp2.py) and a
# context-parallel smoke run of benchmarks/context_parallel.py. Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
start=$(date +%s)
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/env.txt"
timeout 330 python3 -m pytest -m gpu -q --timeout 240 -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.txt" 2>&1
grep -E "passed|failed|error" "$OUT/gpu_tests.txt" | tail -3
if [ -d .ext ]; then
  timeout 90 bash .ext/run.sh > "$OUT/ext_suites.txt" 2>&1; tail -1 "$OUT/ext_suites.txt"
fi
echo "== FSDP2, one rank, $(( $(date +%s) - start )) s in"
timeout 150 torchrun --nproc_per_node 1 --standalone benchmarks/fsdp2.py --out "$OUT" 2>&1 | grep "^|\|^llama"
echo "== context parallel smoke, $(( $(date +%s) - start )) s in"
timeout 100 torchrun --nproc_per_node 2 --standalone benchmarks/context_parallel.py --shape small --lora-rank 8 \
  --tokens-per-gpu 4096 --warmup 1 --steps 2 --out "$OUT" 2>&1 | grep "RESULT\|Error\|error" | head -5
echo "== done in $(( $(date +%s) - start )) s"
