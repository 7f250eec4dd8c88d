#!/usr/bin/env bash
# On a host of 2 GPUs: the kept-attention, engine, release and disk GPU tests (GPU 0), then the
# tests that need two GPUs (context parallel with kept outputs as DTensors); the 8B LoRA at
# 256K, 2 layers, offload_plan: auto, before (.snap_before) and after (GPU 1). Run from .snap.
. "$(dirname "$0")/common.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{ python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
  nvidia-smi -L | head -2; echo "commit ${OFFLOADKIT_COMMIT:-} before ${BEFORE_COMMIT:-}"; } | tee "$OUT/env.txt"
( CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -m gpu -q --timeout 150 -p no:cacheprovider -rfE \
    tests/gpu/test_kept_attention_cuda.py tests/gpu/test_engine_cuda.py tests/gpu/test_release_cuda.py \
    tests/gpu/test_disk_cuda.py > "$OUT/gpu_tests.txt" 2>&1
  say "single: $(tail -1 "$OUT/gpu_tests.txt")"
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/gpu/test_context_parallel_cuda.py \
    > "$OUT/gpu_tests_multi.txt" 2>&1
  say "two GPUs: $(tail -1 "$OUT/gpu_tests_multi.txt")" ) &
( export CUDA_VISIBLE_DEVICES=1
  for side in before after; do
    dir=$PWD; [ $side = before ] && dir=$PWD/../.snap_before
    (cd "$dir" && PYTHONPATH=$dir timeout 150 python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 \
      --probes "auto:262144:2:1:2" --budget-s 140 --out "$OUT/cap_$side" --name cap 2>&1 | grep -E "^\| auto" | tail -1)
    say "256K $side"
  done ) &
wait
grep -hE "^(FAILED|ERROR)" "$OUT"/gpu_tests*.txt
say "done"
