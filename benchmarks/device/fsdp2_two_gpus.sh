#!/usr/bin/env bash
# On a machine with 2 GPUs: the GPU suite, then FSDP2 + checkpointing + block-input offload
# (benchmarks/fsdp2.py under torchrun). Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.get_device_name())" | tee "$OUT/env.txt"
timeout 300 python3 -m pytest -m gpu -q --timeout 200 -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
timeout 250 torchrun --nproc_per_node 2 --standalone benchmarks/fsdp2.py --out "$OUT" 2>&1 | grep -v Warning | tail -12
