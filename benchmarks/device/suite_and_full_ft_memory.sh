#!/usr/bin/env bash
# On one GPU: the whole GPU suite, then a full fine-tune's reserved memory and step time
# (benchmarks/full_ft_peers.py, 3B at 16K, fp32 master weights, with and without the chunked
# loss) and the Trainer-route probes (benchmarks/trainer_overheads.py, full fine-tune cases).
# Then the default `offloadkit train` (benchmarks/device/first_run.sh). Results under $OUT: gpu_tests.txt,
# env.txt, full-ft-peers.{json,md}, trainer-overheads-after.json, first-run-gpu.tar, progress.txt.
. "$(dirname "$0")/common.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/env.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/env.txt"
say "GPU suite"
# The files nearest the latest changes first: a suite cut short by its timeout has run them.
first="full_ft_memory backward_adamw backward_sgd reentrant_updates trainable_streaming prefetch_scheduler cli edges kept_attention
  recompute_inputs longctx engine layers disk transfer attention_groups trainer_cells compat matrix"
files=$(for f in $first; do echo tests/gpu/test_${f}_cuda.py; done)
rest=$(ls tests/gpu/test_*_cuda.py | grep -v -F "$files")
timeout "${SUITE_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=10 $files $rest \
  > "$OUT/gpu_tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -15
say "full fine-tune peers (offloadkit modes), 3B"
python3 benchmarks/full_ft_peers.py --out /tmp/peers --shapes llama-3.2-3b --modes offloadkit,offloadkit+chunked_loss \
  2>&1 | grep -v "^{" | tail -8
cp /tmp/peers/full-ft-peers.json /tmp/peers/full-ft-peers.md "$OUT/" 2>/dev/null
say "Trainer-route probes"
python3 benchmarks/trainer_overheads.py --out "$OUT" --cases "${CASES:-fullft-prepare,fullft-train}" --tag=-after \
  2>&1 | cut -c1-300
say "the default offloadkit train (first run)"
OUT=/tmp/first-run bash benchmarks/device/first_run.sh gpu > /dev/null 2>&1
tar -C /tmp/first-run -cf "$OUT/first-run-gpu.tar" gpu && tail -3 /tmp/first-run/gpu/stdout.txt
say "done"
