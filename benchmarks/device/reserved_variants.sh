#!/usr/bin/env bash
# On one GPU: a full fine-tune's reserved against allocated memory with BackwardAdamW's state
# buffers from different places (full_ft_peers.py --state-allocation, a diagnostic) and with
# the state looked ahead by layers; then the Trainer route's activation waits with the
# library as it is. Results under $OUT: peers-<variant>.json, trainer-route-waits.json.
. "$(dirname "$0")/common.sh"
for v in ${ALLOCS:-as_is flat pool flat+pool}; do
  for g in "" --update-groups; do
    say "state allocation $v $g"
    python3 benchmarks/full_ft_peers.py --out /tmp/p --shapes llama-3.2-3b --modes offloadkit,offloadkit+chunked_loss \
      --warmup 2 --steps 2 --state-allocation "$v" $g 2>&1 | grep "| llama"
    cp /tmp/p/full-ft-peers.json "$OUT/peers-${v/+/_}${g:+-groups}.json"
  done
done
say "Trainer route waits"
python3 benchmarks/trainer_route_waits.py --out "$OUT" --variants "${VARIANTS:-as_is,horizon4,no_state}" 2>&1 | cut -c1-400
say "done"
