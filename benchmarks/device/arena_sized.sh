#!/usr/bin/env bash
# On one GPU: the optimizer's GPU tests, the full fine-tune memory tests and the CLI's default
# run; a 3B full fine-tune's memory with the state arena by hand (with and without the chunked
# loss) and through prepare() and offloadkit train. Results under $OUT.
. "$(dirname "$0")/common.sh"
{ python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
  echo "commit ${OFFLOADKIT_COMMIT:-}"; } | tee "$OUT/env.txt"
say "GPU tests"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --timeout 200 tests/gpu/test_backward_adamw_cuda.py \
  tests/gpu/test_full_ft_memory_cuda.py tests/gpu/test_backward_sgd_cuda.py tests/gpu/test_reentrant_updates_cuda.py \
  "tests/gpu/test_cli_cuda.py::test_cli_default_run_saves_gpu_memory_and_learns" > "$OUT/gpu_tests.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -8
say "3B by hand"
timeout 200 python3 benchmarks/full_ft_peers.py --out /tmp/p --shapes llama-3.2-3b --modes offloadkit,offloadkit+chunked_loss \
  --warmup 2 --steps 2 --update-groups 2>&1 | grep "| llama"
cp /tmp/p/full-ft-peers.json "$OUT/peers-arena-sized.json"
say "3B through prepare() and offloadkit train"
timeout 240 python3 benchmarks/trainer_overheads.py --out /tmp/to --cases fullft-prepare,fullft-train --tag=-arena-sized 2>&1 | cut -c1-160
cp /tmp/to/trainer-overheads-arena-sized.json "$OUT/"
say "done"
