#!/usr/bin/env bash
# Long-context round on one 80 GB H100, under 9 minutes: the long-context GPU tests, the
# planner's 8B plan at 512K, then benchmarks/capacity.py (each probe in its own process;
# probes whose predicted time does not fit what is left are skipped and say so).
# Results under $OUT: gpu_tests_longctx.txt, plan-8b-*.txt, capacity.{json,md}, env.txt.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-530}
start=$(date +%s)
left() { echo $(( TOTAL_S - ($(date +%s) - start) )); }

{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2; df -h "${TMPDIR:-/tmp}" | tail -1
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} > "$OUT/env.txt" 2>&1

echo "== GPU tests (longctx), $(left) s left"
timeout 150 python3 -m pytest -m gpu -q --timeout 140 -p no:cacheprovider tests/gpu/test_longctx_cuda.py 2>&1 \
  | tee "$OUT/gpu_tests_longctx.txt" | tail -6

echo "== planner, $(left) s left"
for seq in 131072 524288; do
  timeout 60 python3 -m offloadkit plan --shape llama-3-8b --seq-len $seq --lora-rank 16 --measure > "$OUT/plan-8b-$seq.txt" 2>&1
  tail -3 "$OUT/plan-8b-$seq.txt"
done

# Probes, most needed first: mode:seq_len:layers:warmup:steps; a|b = b when a does not fit the time left.
PROBES="hf_ckpt:16384:32:1:2;everything:16384:32:1:2"          # the 16K row: step-time ratio and peak
PROBES+=";everything:32768:32:1:1"                              # step time at 32K, full depth
PROBES+=";everything:65536:4:1:1;everything:65536:8:1:1"        # depth independence at 64K
PROBES+=";everything:262144:2:0:1"                              # large, reduced depth
PROBES+=";everything:65536:32:0:1"                              # step time at 64K, full depth
PROBES+=";everything:131072:32:0:1|everything:131072:8:0:1"     # 128K: full depth if time allows, else 8 layers
PROBES+=";everything:327680:2:0:1"                              # just past the planner's longest (~306K)
PROBES+=";hf_ckpt:32768:32:0:1"                                 # plain checkpointing past 16K
PROBES+=";everything:393216:2:0:1;everything:524288:2:0:1"      # 384K, 512K (the planner predicts OOM)
echo "== capacity, $(left) s left"
python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --budget-s "$(( $(left) - 10 ))" \
  --out "$OUT" --name capacity-8b-lora-h100 --probes "$PROBES" 2>&1 | grep -v -i warn
echo "== done in $(( $(date +%s) - start )) s"
