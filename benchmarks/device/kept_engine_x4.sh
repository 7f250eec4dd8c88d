#!/usr/bin/env bash
# On a host of 4 GPUs, at once: the single-GPU suite over GPUs 0 and 1, then the tests that
# need two GPUs on them; the 3B full fine-tune's memory with the state arena at half its
# measured size (diagnostic) and one allocation a parameter (GPU 2); the 8B LoRA at 256K,
# 2 layers, as offload_plan: auto plans it, before (.snap_before) and after (.snap) kept
# attention outputs went through the engine, alternating, with a kernel-time breakdown (GPU 3).
# Run from .snap; results under $OUT.
. "$(dirname "$0")/common.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{ python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
  nvidia-smi -L | head -4; echo "commit ${OFFLOADKIT_COMMIT:-} before ${BEFORE_COMMIT:-}"; } | tee "$OUT/env.txt"
say "start"
suite_on_gpus_0_1 &
( export CUDA_VISIBLE_DEVICES=2
  timeout 200 python3 benchmarks/full_ft_peers.py --out /tmp/p_half --shapes llama-3.2-3b \
    --modes offloadkit+chunked_loss --warmup 2 --steps 2 --update-groups --state-allocation arena_half 2>&1 | grep "| llama"
  cp /tmp/p_half/full-ft-peers.json "$OUT/peers-arena-half.json"; say "peers arena_half done" ) &
( export CUDA_VISIBLE_DEVICES=3
  for round in 1 2; do
    for side in before after; do
      dir=$PWD; [ $side = before ] && dir=$PWD/../.snap_before
      (cd "$dir" && PYTHONPATH=$dir timeout 200 python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 \
        --probes "auto:262144:2:1:2" --budget-s 190 --out /tmp/cap_${side}_$round --name cap \
        $([ $round = 2 ] && echo --kernel-breakdown) 2>&1 | grep -E "auto|step|peak" | tail -3)
      say "256K $side round $round"
    done
  done
  python3 - "$OUT" <<'PY'
import glob, json, sys
rows = {}
for f in sorted(glob.glob("/tmp/cap_*/*.json")):
    rows[f] = json.load(open(f))
json.dump(rows, open(sys.argv[1] + "/cap-256k-before-after.json", "w"), indent=1)
PY
) &
wait
grep -hE "^(FAILED|ERROR)" "$OUT"/gpu_tests_*.txt
say "done"
