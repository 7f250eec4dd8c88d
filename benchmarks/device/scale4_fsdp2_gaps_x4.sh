#!/usr/bin/env bash
# On a host of 4 GPUs, the runs past one GPU still owed, one call:
# In the order of what is owed most (an interrupted call keeps the earlier parts):
#   C: the tests that need several GPUs (the Trainer under FSDP2 among them) at 2 ranks and at 4,
#      and the single-GPU suite on GPUs 2 and 3 beside the two-rank tests
#   B: the 8B full fine-tune under FSDP2 at 16K a rank: block inputs offloaded with torch AdamW,
#      with BackwardAdamW, and with BackwardAdamW fetching its state a layer ahead, each with a
#      kernel breakdown that lists the compute stream's longest gaps
#   A: weak scaling's 4-rank row at full depth (8B LoRA r=16, context parallel, the planner's
#      choices, 131,072 tokens a GPU; the one- and two-rank rows: ../results/multi-gpu/h200x4-2a931d1/)
#   D: the full-depth host and disk footprint of the planner's longest 8B LoRA sequence over the
#      4 ranks, every rank at once (benchmarks/footprint.py --world-size 4), restored inputs checked
# GPU_GIB=79 caps each process to an H100's memory on a larger card. Results under $OUT
# (progress.txt, env.txt, logs, json records). Run from .snap; longer than one command: start
# it with setsid and collect $OUT later.
. "$(dirname "$0")/common.sh"
several_gpu_setup

say "C: tests on several GPUs (and the single-GPU suite on GPUs 2 and 3 meanwhile)"
deal_suite 2
for g in 0 1; do
  CUDA_VISIBLE_DEVICES=$(( g + 2 )) timeout 330 python3 -m pytest -m gpu -q --timeout 240 -p no:cacheprovider -rfE \
    ${groups[$g]} > "$OUT/gpu_tests_$(( g + 2 )).txt" 2>&1 &
done
several_gpu_tests_two
wait
say "single-GPU suite: $(tail -n 1 "$OUT/gpu_tests_2.txt") | $(tail -n 1 "$OUT/gpu_tests_3.txt")"
several_gpu_tests_four

say "B: FSDP2 8B full fine-tune, 4 x 16K"
timeout 420 torchrun --standalone --nproc_per_node 4 benchmarks/fsdp2.py --shape llama-3-8b --seq-len 16384 --steps 3 \
  --modes ckpt+input_offload,ckpt+input_offload+backward_adamw,ckpt+input_offload+backward_adamw+layer_groups \
  --kernel-breakdown --out "$OUT/fsdp2" > "$OUT/fsdp2_16k.txt" 2>&1
say "fsdp2 rc=$?"; grep -A5 "^| mode" "$OUT/fsdp2_16k.txt" | tee -a "$OUT/progress.txt"

say "A: weak scaling, 4 x 131072, full depth"
timeout "${SCALE_LIMIT:-560}" torchrun --standalone --nproc_per_node 4 benchmarks/context_parallel.py --shape llama-3-8b \
  --lora-rank 16 --tokens-per-gpu 131072 --warmup 1 --steps 1 "${CAP[@]}" --out "$OUT/cp" > "$OUT/scale_4.txt" 2>&1
say "scale 4 rc=$? $(grep -h -m1 -E '^(RESULT|OOM)' "$OUT/scale_4.txt") $(grep -c 'host-memory budget reached' "$OUT/scale_4.txt") budget warnings"

say "D: full-depth footprint of the planner's longest over 4 ranks"
mkdir -p /tmp/okdisk
timeout 540 torchrun --standalone --nproc_per_node 4 benchmarks/footprint.py --lora-rank 16 --seq-len 0 --world-size 4 \
  "${CAP[@]}" --disk-dir /tmp/okdisk --out "$OUT/footprint" > "$OUT/footprint.txt" 2>&1
say "footprint rc=$? $(grep -h -o '"restored_inputs_exact": [a-z]*' "$OUT"/footprint/*.json 2>/dev/null | sort | uniq -c | tr '\n' ' ')"
rm -rf /tmp/okdisk
say "done"
