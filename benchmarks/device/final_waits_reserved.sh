#!/usr/bin/env bash
# On one GPU: the Trainer-route wait test (state by layers against the byte window), the waits
# with the library as it is and with a longer activation horizon, a full fine-tune's memory
# with the state by layers and with the allocator's free pages given back each step
# (diagnostic), and the Trainer-route probes. Results under $OUT.
. "$(dirname "$0")/common.sh"
{ python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
  echo "commit ${OFFLOADKIT_COMMIT:-}"; } | tee "$OUT/env.txt"
say "wait test"
python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --timeout 200 \
  "tests/gpu/test_full_ft_memory_cuda.py" > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
say "Trainer route waits"
python3 benchmarks/trainer_route_waits.py --out "$OUT" --variants as_is,horizon4 2>&1 | cut -c1-300
for flags in "--update-groups" "--update-groups --empty-cache-each-step"; do
  say "full fine-tune 3B 16K $flags"
  python3 benchmarks/full_ft_peers.py --out /tmp/p --shapes llama-3.2-3b --modes offloadkit,offloadkit+chunked_loss \
    --warmup 2 --steps 2 $flags 2>&1 | grep "| llama"
  n=$(echo "$flags" | tr -dc 'a-z' | cut -c1-30); cp /tmp/p/full-ft-peers.json "$OUT/peers-$n.json"
done
say "Trainer-route probes"
python3 benchmarks/trainer_overheads.py --out "$OUT" --cases fullft-prepare,fullft-train --tag=-groups 2>&1 | cut -c1-200
say "done"
