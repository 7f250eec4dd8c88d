#!/usr/bin/env bash
# Several GPUs on one host: the two-GPU parity tests (updates in backward under DDP, FSDP2 and
# context parallelism; context parallel against one process), then context parallelism on the
# 8B LoRA r=16 the long-context results use: a probe at 64K with the planner's choices, weak
# scaling at 128K tokens per GPU (1 GPU, then every GPU), and the longest sequence asked for.
#   bash benchmarks/device/multi_gpu.sh [TOKENS_PER_GPU_FOR_CAPACITY] [CAPACITY_LAYERS]
source benchmarks/device/common.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
GPUS=$(nvidia-smi -L | wc -l)
CAP_TOKENS=${1:-819200}
CAP_LAYERS=${2:-1}
nvidia-smi -L > "$OUT/gpus.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> "$OUT/gpus.txt"
git rev-parse HEAD >> "$OUT/gpus.txt" 2>/dev/null || echo "${OFFLOADKIT_COMMIT:-unknown}" >> "$OUT/gpus.txt"

say "two-GPU tests"
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_distributed_updates_cuda.py \
  tests/gpu/test_context_parallel_cuda.py > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt"

cp_run() {  # NPROC LOG ARGS...: one context-parallel run; the log keeps its whole traceback
  local n=$1 log=$2; shift 2
  timeout 420 torchrun --standalone --nproc_per_node "$n" benchmarks/context_parallel.py --shape llama-3-8b \
    --lora-rank 16 --out "$OUT/cp" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  say "$log rc=$rc $(grep RESULT "$OUT/$log" | head -1)"
  return $rc
}

say "probe: the planner's choices at 64K, one process"
cp_run 1 probe_64k_1.txt --tokens-per-gpu 65536 --layers 2 || \
  CUDA_LAUNCH_BLOCKING=1 cp_run 1 probe_64k_1_blocking.txt --tokens-per-gpu 65536 --layers 2
cp_run "$GPUS" probe_64k_n.txt --tokens-per-gpu 65536 --layers 2

say "weak scaling at 128K per GPU, 2 layers"
for n in 1 "$GPUS"; do
  cp_run "$n" "scale_${n}.txt" --tokens-per-gpu 131072 --layers 2 --warmup 1 --steps 2 || \
    cp_run "$n" "scale_${n}_nokeep.txt" --tokens-per-gpu 131072 --layers 2 --warmup 1 --steps 2 \
      --set keep_attention_outputs=false
done

say "capacity: $GPUS x $CAP_TOKENS tokens, $CAP_LAYERS layers"
cp_run "$GPUS" capacity.txt --tokens-per-gpu "$CAP_TOKENS" --layers "$CAP_LAYERS"
say "done"
tar -czf "$OUT/logs.tgz" -C "$OUT" cp $(cd "$OUT" && ls *.txt) 2>/dev/null
