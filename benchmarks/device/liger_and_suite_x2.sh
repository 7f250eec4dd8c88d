#!/usr/bin/env bash
# On a host of 2 GPUs, liger-kernel installed under /tmp/site (carried as a wheel):
#   GPU 0: the whole single-GPU suite with liger-kernel importable, then the two-GPU tests.
#   GPU 1: the 8B LoRA at 64K and 256K (2 layers, offload_plan: auto, --kernel-breakdown)
#          without liger-kernel (auto leaves the layer eager) and with it (auto turns the
#          kernels on), interleaved; then what is alive at the 16K everything-on peak
#          (4 layers, --peak-breakdown) in this tree and in ../.snap_before.
# Results under $OUT. Run from .snap.
. "$(dirname "$0")/common.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
BASE_PATH=$PWD
{ python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
  PYTHONPATH=/tmp/site:$PWD python3 -c "import liger_kernel, importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))"
  nvidia-smi -L | head -2; echo "commit ${OFFLOADKIT_COMMIT:-} before ${BEFORE_COMMIT:-}"; } | tee "$OUT/env.txt"
deal_suite 1
( export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site:$PWD
  timeout 400 python3 -m pytest -m gpu -q --timeout 240 -p no:cacheprovider -rfE \
    tests/gpu/test_liger_kernels_cuda.py ${groups[0]} > "$OUT/gpu_tests_0.txt" 2>&1
  say "single-GPU suite: $(tail -n 1 "$OUT/gpu_tests_0.txt")" ) &
( export CUDA_VISIBLE_DEVICES=1
  for seq in 65536 262144; do
    for side in eager liger; do
      path=$PWD; [ $side = liger ] && path=/tmp/site:$PWD
      PYTHONPATH=$path timeout 200 python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 \
        --probes "auto:$seq:2:1:2" --kernel-breakdown --budget-s 190 --out "$OUT/ab" --name "auto-$seq-$side" \
        2>&1 | grep -E "^\| auto" | tail -1
      say "$seq $side"
    done
  done
  for side in this before; do
    dir=$PWD; [ $side = before ] && dir=$PWD/../.snap_before
    (cd "$dir" && PYTHONPATH=$dir timeout 150 python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 \
      --probes "everything:16384:4:1:2" --peak-breakdown --budget-s 140 --out "$OUT/peak" --name "peak16k-$side" \
      2>&1 | grep -E "^\| everything" | tail -1)
    say "16K peak $side"
  done ) &
wait
CUDA_VISIBLE_DEVICES=0,1 timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE $MULTI \
  > "$OUT/gpu_tests_multi.txt" 2>&1
say "two GPUs: $(tail -n 1 "$OUT/gpu_tests_multi.txt")"
grep -hE "^(FAILED|ERROR)" "$OUT"/gpu_tests*.txt
say "done"
