#!/usr/bin/env bash
# On a host of 4 GPUs (capped to an H100's memory with GPU_GIB=79 on a larger card), what is
# owed past one GPU after b695acf, one call:
#   A: two hosts of two GPUs simulated (two torchrun launchers, --nnodes 2, each its own GPUs,
#      spill directory and RAM budget): DDP with block inputs on each host's disk against one process;
#      then BackwardAdamW under FSDP2 on 2 GPUs (plain, accumulating, through the Trainer)
#      and, meanwhile, the single-GPU suite on GPUs 2 and 3
#   B: the planner's longest 8B LoRA r=16 sequence over the 4 ranks, context parallel, 1 layer whose
#      input needs a gradient (a middle layer's memory), all-to-all rotation; PEAK_BREAKDOWN=1:
#      one more step recording what is alive at its peak (where the planner's count is high)
#   C: the full-depth host and disk footprint of that same sequence over the 4 ranks, every rank at
#      once, every restored block input checked (benchmarks/footprint.py --world-size 4)
# Results under $OUT (progress.txt, env.txt, logs, json records). Longer than one command: start
# it with setsid from .snap and collect $OUT with later calls.
. "$(dirname "$0")/common.sh"
several_gpu_setup

say "A: two hosts of two GPUs; FSDP2's updates in backward with gradient accumulation, on 2 GPUs"
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/gpu/test_multinode_cuda.py \
  > "$OUT/gpu_tests_hosts.txt" 2>&1
say "two hosts: $(tail -n 1 "$OUT/gpu_tests_hosts.txt")"
# Meanwhile the single-GPU suite on GPUs 2 and 3 (everything GPU-facing since the last run).
deal_suite 2
for g in 0 1; do
  CUDA_VISIBLE_DEVICES=$(( g + 2 )) timeout 330 python3 -m pytest -m gpu -q --timeout 240 -p no:cacheprovider -rfE \
    ${groups[$g]} > "$OUT/gpu_tests_$(( g + 2 )).txt" 2>&1 &
done
CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE \
  tests/gpu/test_distributed_updates_cuda.py -k "two_gpus and fsdp2" > "$OUT/gpu_tests_fsdp2.txt" 2>&1
say "FSDP2 updates, 2 GPUs: $(tail -n 1 "$OUT/gpu_tests_fsdp2.txt")"
wait
say "single-GPU suite: $(tail -n 1 "$OUT/gpu_tests_2.txt") | $(tail -n 1 "$OUT/gpu_tests_3.txt")"
grep -hE "^(FAILED|ERROR)" "$OUT"/gpu_tests*.txt | tee -a "$OUT/progress.txt"

say "B: the planner's longest over 4 ranks, 1 layer"
timeout 560 torchrun --standalone --nproc_per_node 4 benchmarks/context_parallel.py --shape llama-3-8b --lora-rank 16 \
  --tokens-per-gpu 0 --layers 1 --input-grads "${CAP[@]}" --rotation alltoall --out "$OUT/cp" \
  ${PEAK_BREAKDOWN:+--peak-breakdown} > "$OUT/longest_4.txt" 2>&1
say "longest rc=$? $(grep -h -m1 -E '^(RESULT|OOM)' "$OUT/longest_4.txt")"
TOKENS=$(python3 -c "import glob, json; print(max(json.load(open(f))['tokens'] for f in glob.glob('$OUT/cp/*.json')))" 2>/dev/null || echo 0)

say "C: full-depth footprint of $TOKENS tokens over 4 ranks"
mkdir -p /tmp/okdisk
timeout 560 torchrun --standalone --nproc_per_node 4 benchmarks/footprint.py --lora-rank 16 --seq-len "$TOKENS" \
  --world-size 4 "${CAP[@]}" --disk-dir /tmp/okdisk --out "$OUT/footprint" > "$OUT/footprint.txt" 2>&1
say "footprint rc=$? $(grep -h -o '"restored_inputs_exact": [a-z]*' "$OUT"/footprint/*.json 2>/dev/null | sort | uniq -c | tr '\n' ' ')"
rm -rf /tmp/okdisk
say "done"
