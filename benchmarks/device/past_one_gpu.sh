#!/usr/bin/env bash
# Past one GPU on one host of N GPUs (4 for the figures quoted), each phase in turn:
#   tests     the parity tests at four ranks (context parallel against one process; updates in
#             backward under DDP, FSDP2, context parallel) and the fused LoRA tests
#   peer      accelerate's FSDP2 + context parallel (benchmarks/cp_peer.py), 8B LoRA r=16 at full
#             depth: its longest sequence, a ladder of tokens per GPU stopping at the first failure
#   side      the peer and offloadkit (benchmarks/context_parallel.py, the planner's choices) at the
#             same tokens, at $SIDE_LAYERS layers: warm-up step, then the median of two
#   fsdp2     8B full fine-tune under FSDP2 (benchmarks/fsdp2.py): Hugging Face checkpointing and
#             torch AdamW against block inputs offloaded and BackwardAdamW (state in host memory) at
#             16K a rank; then the longest a rank reaches, FSDP2's CPUOffloadPolicy against offloadkit
#   capacity  the planner's longest context-parallel sequence, 1 layer whose input needs a gradient
#             (a middle layer's memory), each rank capped to 79 GiB
#   PHASES="tests peer side fsdp2 capacity" GPU_GIB=79 bash benchmarks/device/past_one_gpu.sh
# Results under $RESULTS (default $OUT): progress.txt, env.txt, logs, json records.
source benchmarks/device/common.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
RESULTS=${RESULTS:-$OUT}; mkdir -p "$RESULTS"/{cp,fsdp2}
OUT=$RESULTS
GPUS=$(nvidia-smi -L | wc -l)
PHASES=${PHASES:-tests peer side fsdp2 capacity}
SIDE_LAYERS=${SIDE_LAYERS:-4}
# GPU_GIB=79 caps every process (and offloadkit's plan) to an H100's memory on a larger card.
CAP=(); [[ -n ${GPU_GIB:-} ]] && CAP=(--gpu-gib "$GPU_GIB")
{ nvidia-smi -L; python3 -c "import torch, transformers, peft, accelerate; print(torch.__version__, transformers.__version__, peft.__version__, accelerate.__version__)"
  echo "commit ${OFFLOADKIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; } > "$RESULTS/env.txt"

run() {  # LOG TIMEOUT NPROC SCRIPT ARGS...: one torchrun; the log keeps its whole traceback
  local log=$1 limit=$2 n=$3; shift 3
  timeout "$limit" torchrun --standalone --nproc_per_node "$n" "$@" > "$RESULTS/$log" 2>&1
  local rc=$?
  say "$log rc=$rc $(grep -h -m1 -E '^(RESULT|OOM)' "$RESULTS/$log")"
  return $rc
}

if [[ " $PHASES " == *" tests "* ]]; then
  say "tests"
  timeout 600 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE -k "four" \
    tests/gpu/test_distributed_updates_cuda.py tests/gpu/test_context_parallel_cuda.py > "$RESULTS/tests_four.txt" 2>&1
  say "four ranks: $(tail -1 "$RESULTS/tests_four.txt")"
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
    tests/gpu/test_fused_lora_cuda.py > "$RESULTS/tests_fused.txt" 2>&1
  say "fused: $(tail -1 "$RESULTS/tests_fused.txt")"
fi

PEER_FIT=${PEER_FIT:-}
if [[ " $PHASES " == *" peer "* ]]; then
  say "peer ladder, full depth, $GPUS GPUs"
  for t in ${PEER_LADDER:-32768 65536 98304 131072}; do
    run "peer_${GPUS}x${t}.txt" 420 "$GPUS" benchmarks/cp_peer.py --tokens-per-gpu "$t" --warmup 0 --steps 1 \
      "${CAP[@]}" --out "$RESULTS/cp" || break
    PEER_FIT=$t
  done
  say "peer's longest: ${PEER_FIT:-none} a GPU"
fi

if [[ " $PHASES " == *" side "* ]]; then
  for t in ${SIDE_TOKENS:-32768 ${PEER_FIT:-65536}}; do
    say "side by side: $GPUS x $t, $SIDE_LAYERS layers"
    run "side_peer_${t}.txt" 300 "$GPUS" benchmarks/cp_peer.py --tokens-per-gpu "$t" --layers "$SIDE_LAYERS" \
      --warmup 1 --steps 2 "${CAP[@]}" --out "$RESULTS/cp"
    run "side_ours_${t}.txt" 300 "$GPUS" benchmarks/context_parallel.py --shape llama-3-8b --lora-rank 16 \
      --tokens-per-gpu "$t" --layers "$SIDE_LAYERS" --warmup 1 --steps 2 "${CAP[@]}" --out "$RESULTS/cp"
  done
fi

if [[ " $PHASES " == *" fsdp2 "* ]]; then
  say "FSDP2 8B full fine-tune, $GPUS GPUs, 16K a rank"
  run "fsdp2_16k.txt" 420 "$GPUS" benchmarks/fsdp2.py --shape llama-3-8b --seq-len 16384 --steps 3 \
    --modes hf_ckpt,ckpt,ckpt+input_offload,ckpt+input_offload+backward_adamw --kernel-breakdown --out "$RESULTS/fsdp2"
  grep -A4 "^| mode" "$RESULTS/fsdp2_16k.txt" | tee -a "$RESULTS/progress.txt"
  for mode in cpu_offload_policy ckpt+input_offload+backward_adamw; do
    for s in ${FSDP2_LADDER:-32768 65536 131072}; do
      extra=(); [[ $mode == ckpt* ]] && extra=(--chunked-loss 16)
      run "fsdp2_${mode}_${s}.txt" 300 "$GPUS" benchmarks/fsdp2.py --shape llama-3-8b --seq-len "$s" --steps 1 \
        --modes "$mode" "${extra[@]}" --out "$RESULTS/fsdp2" || break
      grep -A2 "^| mode" "$RESULTS/fsdp2_${mode}_${s}.txt" | tail -1 | tee -a "$RESULTS/progress.txt"
    done
  done
fi

if [[ " $PHASES " == *" capacity "* ]]; then
  say "capacity: the planner's longest on $GPUS ranks (${CAP_TOKENS:=0} a rank; 0: the planner's), 1 layer, input gradients, 79 GiB a rank"
  run "capacity_${GPUS}.txt" 560 "$GPUS" benchmarks/context_parallel.py --shape llama-3-8b --lora-rank 16 \
    --tokens-per-gpu "$CAP_TOKENS" --layers 1 --input-grads --gpu-gib "${GPU_GIB:-79}" --rotation alltoall \
    --out "$RESULTS/cp"
fi
say "done"
