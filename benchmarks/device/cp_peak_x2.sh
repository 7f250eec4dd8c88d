#!/usr/bin/env bash
# On a host of 2 GPUs (GPU_GIB=79 caps each to an H100's memory): what the planner counts too
# much of at the 4-rank longest's share, 795,136 tokens a rank, 1 layer whose input needs a
# gradient, all-to-all rotation. The same share on one rank and on two, each with one more step
# recording what is alive at its peak (--peak-breakdown):
#   on 4 ranks it measured 57.83 GiB against 63.82 predicted, on 1 rank 57.77 against 60.19:
#   the ring's 3.63 GiB of buffers did not raise the peak; the breakdowns say which part is high.
# About 6 minutes. Results under $OUT.
. "$(dirname "$0")/common.sh"
several_gpu_setup
SHARE=${SHARE:-795136}
for n in 1 2; do
  say "$n rank(s), $SHARE tokens a rank"
  timeout 420 torchrun --standalone --nproc_per_node "$n" benchmarks/context_parallel.py --shape llama-3-8b \
    --lora-rank 16 --tokens-per-gpu "$SHARE" --layers 1 --input-grads "${CAP[@]}" --rotation alltoall \
    --peak-breakdown --out "$OUT/cp" > "$OUT/cp_$n.txt" 2>&1
  say "rc=$? $(grep -h -m1 -E '^(RESULT|OOM)' "$OUT/cp_$n.txt")"
done
say "done"
