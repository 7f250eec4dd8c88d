#!/usr/bin/env bash
# On one GPU: the whole GPU suite (the files nearest the latest changes first), then what a
# full fine-tune's allocator holds at its peaks (benchmarks/full_ft_peers.py --memory-trace,
# 3B at 16K, fp32 master weights, with and without the chunked loss). Results under $OUT:
# env.txt, gpu_tests.txt, full-ft-peers.json, progress.txt.
. "$(dirname "$0")/common.sh"
{ python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
  echo "commit ${OFFLOADKIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; } | tee "$OUT/env.txt"
say "GPU suite"
first="full_ft_memory transfer embeddings fused_lora backward_adamw backward_sgd reentrant_updates trainable_streaming
  prefetch_scheduler cli edges kept_attention recompute_inputs longctx engine layers disk"
files=$(for f in $first; do ls tests/gpu/test_${f}_cuda.py 2>/dev/null; done)
rest=$(ls tests/gpu/test_*_cuda.py | grep -v -F "$files")
timeout "${SUITE_TIMEOUT:-330}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --timeout 240 --durations=10 \
  $files $rest > "$OUT/gpu_tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -15
say "full fine-tune, 3B at 16K, memory at the peaks"
python3 benchmarks/full_ft_peers.py --out /tmp/peers --shapes llama-3.2-3b --modes offloadkit,offloadkit+chunked_loss \
  --warmup 1 --steps 2 --memory-trace 2>&1 | grep -v "^{" | tail -8
cp /tmp/peers/full-ft-peers.json "$OUT/" 2>/dev/null
say "done"
