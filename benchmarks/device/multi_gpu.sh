#!/usr/bin/env bash
# Several GPUs on one host: the parity tests that need two GPUs (updates in backward under
# DDP, FSDP2 and context parallelism; context parallel against one process, kept attention
# included), then context parallelism on the 8B LoRA r=16 the long-context results use: weak
# scaling at 128K tokens per GPU at reduced depth (1 GPU, then every GPU; the planner's choices,
# then with attention outputs kept), and the longest sequence asked for.
#   bash benchmarks/device/multi_gpu.sh [TOKENS_PER_GPU] [LAYERS] [extra capacity args...]
#   PHASES="tests scale capacity" (default: all three); SCALE_GPUS="1 4", SCALE_VARIANTS="plan kept",
#   CAP_GPUS="2 4" (default: every GPU)
source benchmarks/device/common.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
GPUS=$(nvidia-smi -L | wc -l)
CAP_TOKENS=${1:-819200}
CAP_LAYERS=${2:-1}
shift 2 2>/dev/null || shift $#
PHASES=${PHASES:-tests scale capacity}
nvidia-smi -L > "$OUT/gpus.txt"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> "$OUT/gpus.txt"
echo "commit ${OFFLOADKIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}" >> "$OUT/gpus.txt"

cp_run() {  # NPROC LOG ARGS...: one context-parallel run; the log keeps its whole traceback
  local n=$1 log=$2; shift 2
  timeout 420 torchrun --standalone --nproc_per_node "$n" benchmarks/context_parallel.py --shape llama-3-8b \
    --lora-rank 16 --out "$OUT/cp" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  say "$log rc=$rc $(grep RESULT "$OUT/$log" | head -1)"
  return $rc
}

if [[ " $PHASES " == *" tests "* ]]; then
  say "tests that need two GPUs"
  timeout 360 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_distributed_updates_cuda.py \
    tests/gpu/test_context_parallel_cuda.py > "$OUT/gpu_tests.txt" 2>&1
  say "$(tail -1 "$OUT/gpu_tests.txt")"
fi

if [[ " $PHASES " == *" scale "* ]]; then
  say "weak scaling at 128K per GPU, 2 layers"
  for n in ${SCALE_GPUS:-1 $GPUS}; do
    for variant in ${SCALE_VARIANTS:-plan kept}; do
      extra=(); [[ $variant == kept ]] && extra=(--set keep_attention_outputs=true)
      cp_run "$n" "scale_${n}_${variant}.txt" --tokens-per-gpu 131072 --layers 2 --warmup 1 --steps 2 "${extra[@]}"
    done
  done
fi

if [[ " $PHASES " == *" capacity "* ]]; then
  for n in ${CAP_GPUS:-$GPUS}; do
    say "capacity: $n x $CAP_TOKENS tokens, $CAP_LAYERS layers $*"
    cp_run "$n" "capacity_${n}.txt" --tokens-per-gpu "$CAP_TOKENS" --layers "$CAP_LAYERS" "$@"
  done
fi
say "done"
tar -czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls -d cp *.txt 2>/dev/null)
