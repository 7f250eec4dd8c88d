#!/usr/bin/env bash
# On a host of 4 GPUs, at once: the single-GPU suite split over GPUs 0 and 1 (then the tests
# that need two GPUs on them), a 3B full fine-tune's memory with the state arena and with one
# allocation per parameter (GPU 2), and the Trainer-route probes and waits (GPU 3).
# Results under $OUT: env.txt, gpu_tests_{0,1,multi}.txt, peers-{arena,per-tensor}.json,
# trainer-overheads-arena.json, trainer-route-waits-arena.json.
. "$(dirname "$0")/common.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{ python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
  nvidia-smi -L; echo "commit ${OFFLOADKIT_COMMIT:-}"; } | tee "$OUT/env.txt"
say "start"
suite_on_gpus_0_1 &
( export CUDA_VISIBLE_DEVICES=2
  for how in as_is per_tensor; do
    timeout 260 python3 benchmarks/full_ft_peers.py --out /tmp/p_$how --shapes llama-3.2-3b \
      --modes offloadkit,offloadkit+chunked_loss --warmup 2 --steps 2 --update-groups --state-allocation $how 2>&1 | grep "| llama"
    n=$([ $how = as_is ] && echo arena || echo per-tensor); cp /tmp/p_$how/full-ft-peers.json "$OUT/peers-$n.json"
    say "peers $how done"
  done ) &
( export CUDA_VISIBLE_DEVICES=3
  timeout 300 python3 benchmarks/trainer_overheads.py --out /tmp/to --cases fullft-prepare,fullft-train --tag=-arena 2>&1 | cut -c1-200
  cp /tmp/to/trainer-overheads-arena.json "$OUT/"; say "trainer overheads done"
  timeout 200 python3 benchmarks/trainer_route_waits.py --out /tmp/rw --variants as_is 2>&1 | cut -c1-300
  cp /tmp/rw/trainer-route-waits.json "$OUT/trainer-route-waits-arena.json"; say "route waits done" ) &
wait
grep -hE "^(FAILED|ERROR)" "$OUT"/gpu_tests_*.txt
say "done"
