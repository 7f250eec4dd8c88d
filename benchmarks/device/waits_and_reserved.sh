#!/usr/bin/env bash
# On one GPU, after the suite: where the Trainer route's GPU waits for activations beside the
# optimizer state's copies (benchmarks/trainer_route_waits.py, each arrangement in a process
# of its own), then a full fine-tune's memory at its peaks (full_ft_peers.py --memory-trace,
# 3B at 16K, fp32 master, with and without the chunked loss) and the Trainer-route probes'
# reserved memory (trainer_overheads.py). Results under $OUT: trainer-route-waits.json,
# full-ft-peers.json, trainer-overheads-after.json, progress.txt.
. "$(dirname "$0")/common.sh"
say "Trainer route waits"
python3 benchmarks/trainer_route_waits.py --out "$OUT" --variants "${VARIANTS:-as_is,no_state,state_on_h2d,state_chunks,priorities,horizon4,loads_off_compute}" 2>&1 | cut -c1-400
say "full fine-tune, 3B at 16K, memory at the peaks"
python3 benchmarks/full_ft_peers.py --out /tmp/peers --shapes llama-3.2-3b --modes offloadkit,offloadkit+chunked_loss \
  --warmup 1 --steps 2 --memory-trace 2>&1 | grep -v "^{" | tail -5
cp /tmp/peers/full-ft-peers.json "$OUT/" 2>/dev/null
if [[ -n "${PROBES:-}" ]]; then
  say "Trainer-route probes"
  python3 benchmarks/trainer_overheads.py --out "$OUT" --cases "$PROBES" --tag=-after 2>&1 | cut -c1-300
fi
say "done"
