#!/usr/bin/env bash
# 512K round on one 80 GB H100, under 9 minutes: the long-context GPU tests (tiled
# projections included), the planner's 8B plan at 512K, then capacity probes with the norms
# and attention projections tiled: 512K and 384K at reduced depth (the GPU peak does not
# depend on depth once block inputs are offloaded and weights streamed), 128K at full depth.
# Results under $OUT: gpu_tests_longctx.txt, plan-8b-524288.txt, capacity-512k.{json,md}, env.txt.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-540}
start=$(date +%s)
left() { echo $(( TOTAL_S - ($(date +%s) - start) )); }

{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2; df -h "${TMPDIR:-/tmp}" | tail -1
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} > "$OUT/env.txt" 2>&1

echo "== GPU tests (longctx), $(left) s left"
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_longctx_cuda.py 2>&1 \
  | tee "$OUT/gpu_tests_longctx.txt" | tail -6

echo "== planner, $(left) s left"
timeout 60 python3 -m offloadkit plan --shape llama-3-8b --seq-len 524288 --lora-rank 16 --measure \
  > "$OUT/plan-8b-524288.txt" 2>&1
tail -3 "$OUT/plan-8b-524288.txt"

PROBES="everything:524288:2:0:1"        # the target length; same GPU peak as 32 layers (horizon 1)
PROBES+=";everything:393216:2:0:1"      # 384K
PROBES+=";everything:131072:32:0:1"     # full depth: step time with the projections tiled
echo "== capacity, $(left) s left"
python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --budget-s "$(( $(left) - 10 ))" \
  --out "$OUT" --name capacity-512k --probes "$PROBES" 2>&1 | grep -v -i warn
echo "== done in $(( $(date +%s) - start )) s"
