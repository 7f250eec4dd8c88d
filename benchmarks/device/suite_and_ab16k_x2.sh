#!/usr/bin/env bash
# On a host of 2 GPUs: the whole single-GPU suite on GPU 0 while GPU 1 runs the 16K rows of
# two trees interleaved (this tree and ../.snap_before, benchmarks/device/ab_16k_rows.sh), then
# the tests that need two GPUs. Results under $OUT: gpu_tests_0.txt, gpu_tests_multi.txt,
# ab/{base,this}/, env.txt, progress.txt. Run from .snap.
. "$(dirname "$0")/common.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{ python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
  nvidia-smi -L | head -2; echo "commit ${OFFLOADKIT_COMMIT:-} before ${BEFORE_COMMIT:-}"; } | tee "$OUT/env.txt"
deal_suite 1
( CUDA_VISIBLE_DEVICES=0 timeout 470 python3 -m pytest -m gpu -q --timeout 240 -p no:cacheprovider -rfE \
    ${groups[0]} > "$OUT/gpu_tests_0.txt" 2>&1
  say "single-GPU suite: $(tail -n 1 "$OUT/gpu_tests_0.txt")" ) &
( CUDA_VISIBLE_DEVICES=1 OUT=$OUT/ab timeout 470 bash benchmarks/device/ab_16k_rows.sh "$PWD/../.snap_before" \
    > "$OUT/ab16k.log" 2>&1
  say "16K rows A/B done" ) &
wait
CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE $MULTI \
  > "$OUT/gpu_tests_multi.txt" 2>&1
say "two GPUs: $(tail -n 1 "$OUT/gpu_tests_multi.txt")"
grep -hE "^(FAILED|ERROR)" "$OUT"/gpu_tests*.txt
say "done"
