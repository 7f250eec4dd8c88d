#!/usr/bin/env bash
# On a host of 4 GPUs, one call:
#   A (at once): the single-GPU suite over GPUs 0 and 1; the 16K rows of this tree and
#     ../.snap_before interleaved on GPU 2 (benchmarks/device/ab_16k_rows.sh); weak scaling's
#     one-GPU row on GPU 3
#   B: weak scaling on 2 GPUs (0, 1), then on 4: 8B LoRA r=16, context parallel, the planner's
#     choices, 131,072 tokens a GPU, full depth (benchmarks/context_parallel.py)
#   C: the 8B full fine-tune under FSDP2 at 16K a rank, the modes that split offloadkit's gap to
#     FSDP2 + checkpointing, with a kernel breakdown of each (benchmarks/fsdp2.py)
#   D: the parity tests at 2 ranks and at 4
# GPU_GIB=79 caps each process to an H100's memory on a larger card. Results under $OUT
# (progress.txt, env.txt, logs, json records). Run from .snap; longer than one command: start
# it with setsid and collect $OUT later.
. "$(dirname "$0")/common.sh"
several_gpu_setup

scale() {  # GPUS N LOG: weak scaling's row for N ranks on the GPUs listed
  local gpus=$1 n=$2
  CUDA_VISIBLE_DEVICES=$gpus timeout "${SCALE_LIMIT:-600}" torchrun --standalone --nproc_per_node "$n" \
    benchmarks/context_parallel.py --shape llama-3-8b --lora-rank 16 --tokens-per-gpu 131072 --warmup 1 --steps 1 \
    "${CAP[@]}" --out "$OUT/cp" > "$OUT/scale_$n.txt" 2>&1
  say "scale $n rc=$? $(grep -h -m1 -E '^(RESULT|OOM)' "$OUT/scale_$n.txt")"
}

deal_suite 2
suite=()
for g in 0 1; do
  CUDA_VISIBLE_DEVICES=$g timeout 420 python3 -m pytest -m gpu -q --timeout 240 -p no:cacheprovider -rfE \
    ${groups[$g]} > "$OUT/gpu_tests_$g.txt" 2>&1 &
  suite+=($!)
done
( CUDA_VISIBLE_DEVICES=2 OUT=$OUT/ab timeout 560 bash benchmarks/device/ab_16k_rows.sh "$PWD/../.snap_before" \
    > "$OUT/ab16k.log" 2>&1; say "16K rows A/B done" ) &
( scale 3 1 ) &
wait "${suite[@]}"
say "single-GPU suite: $(tail -n 1 "$OUT/gpu_tests_0.txt") | $(tail -n 1 "$OUT/gpu_tests_1.txt")"
scale 0,1 2
wait
scale 0,1,2,3 4
say "FSDP2 8B full fine-tune, 4 x 16K"
timeout 480 torchrun --standalone --nproc_per_node 4 benchmarks/fsdp2.py --shape llama-3-8b --seq-len 16384 --steps 3 \
  --modes hf_ckpt,ckpt,ckpt+input_offload,ckpt+input_offload+backward_adamw --kernel-breakdown --out "$OUT/fsdp2" \
  > "$OUT/fsdp2_16k.txt" 2>&1
say "fsdp2 rc=$?"; grep -A6 "^| mode" "$OUT/fsdp2_16k.txt" | tee -a "$OUT/progress.txt"
several_gpu_tests
say "done"
