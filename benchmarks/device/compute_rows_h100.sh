#!/usr/bin/env bash
# On one H100 (or an H200 capped to an H100's 79 GiB: GPU_GIB, set by itself on an H200): the
# compute side's rows still owed, in one run (about 26 minutes; start it with setsid and collect
# $OUT with later calls). Wheels come from .whl/ or, carried over several calls (one carry
# holds 64 MiB), from /tmp/carry/: liger-kernel, FlashAttention-4 and its CuTe DSL (fa4a/,
# fa4b/: the cu13 runtime wheel split over both), Axolotl's stack (axolotl/). A tree of the
# commit before, for rows before and after on this machine, in ../.snap_before or
# ./.snap_before (BEFORE_COMMIT names it). benchmarks/device/stage_wheels.sh stages them all.
#   1. the single-GPU suite (the engine's backward changed), FlashAttention-4 installed
#   2. attention kernels: SDPA's default against FlashAttention-4, 64K and 256K
#   3. 8B LoRA r=16, offload_plan: auto, with Liger's kernels: 256K over 2 layers and 64K over
#      32 layers, each after, before, and with attention_kernel=fa4 (where FA4 ran)
#   4. Axolotl's long-context stack on the same model and tokens, 64K and 256K (hidden-state
#      offload, layer offloading, TiledMLP, Liger's kernels and fused loss; AXOLOTL=0 skips it)
#   5. the 3B full fine-tune at 16K: with Liger's kernels, and with selective checkpointing
#      too, each with a kernel breakdown; then the planner's own choice for it (offloadkit_plan)
#   6. the 8B LoRA at 16K with everything on, before and after
#   7. the 1B full fine-tune at 16K with checkpoint-input offload, before and after
#   8. (EDGE=1) the planner's longest on an H100, 859,136 tokens over 3 layers, with cuDNN and FA4
#   9. the context-parallel path on one rank at the 4-rank longest's share (795,136 tokens, 1 layer
#      whose input needs a gradient): what is alive at its peak, where the plan counts 1.2x
# For rows already measured on an unchanged engine: LORA_BEFORE=0 skips the 8B LoRA rows'
# before runs, LAUNCHES=0 the 64K launches row, EVERYTHING=0 step 6, CP_BREAKDOWN=0 step 9.
# EDGE=1 adds step 8 (about 8 minutes).
. "$(dirname "$0")/common.sh"
mkdir -p .whl
[ -d /tmp/carry ] && cp -rn /tmp/carry/. .whl/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
if [ -f .whl/fa4a/cu13.part.aa ] && [ -f .whl/fa4b/cu13.part.ab ]; then
  cat .whl/fa4a/cu13.part.aa .whl/fa4b/cu13.part.ab > /tmp/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/fa4a/*.whl .whl/fa4b/*.whl /tmp/nvidia_cutlass_dsl_libs_cu13-*.whl > "$OUT/fa4_install.txt" 2>&1
  say "fa4 install rc=$?"
  # Its dependencies this machine may already have: only where missing, so as not to shadow them.
  for dep in cuda.bindings:cuda_bindings cuda.pathfinder:cuda_pathfinder google.protobuf:protobuf; do
    python3 -c "import ${dep%%:*}" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --target /tmp/site .whl/fa4b/opt/${dep#*:}-*.whl >> "$OUT/fa4_install.txt" 2>&1
  done
fi
if [ -d .whl/axolotl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/axolotl/*.whl > "$OUT/axolotl_install.txt" 2>&1
  say "axolotl install rc=$?"
fi
# The CuTe DSL finds its packages through a .pth file, which a PYTHONPATH entry does not read.
SITE=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
GPU_GIB=${GPU_GIB:-$(nvidia-smi -L | grep -q H200 && echo 79)}
CAPB=(); [[ -n $GPU_GIB ]] && CAPB=(--set "gpu_budget_bytes=$(python3 -c "print(int($GPU_GIB * 2**30))")")
BEFORE=""
for d in ../.snap_before .snap_before; do [ -d "$d/offloadkit" ] && BEFORE=$(cd "$d" && pwd) && break; done
{ python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
  PYTHONPATH=$SITE:$PWD python3 -c "
import importlib.metadata as m
for p in ('liger-kernel', 'flash-attn-4', 'nvidia-cutlass-dsl', 'axolotl', 'trl'):
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, 'not installed')"
  nvidia-smi -L | head -1; echo "GPU cap ${GPU_GIB:-none} GiB"
  echo "commit ${OFFLOADKIT_COMMIT:-} before ${BEFORE_COMMIT:-} (${BEFORE:-no tree})"; } | tee "$OUT/env.txt"

say "1: the single-GPU suite, FlashAttention-4 installed"
PYTHONPATH=$SITE:$PWD timeout 480 python3 -m pytest -m gpu -q --timeout 240 -p no:cacheprovider -rfEs \
  $(for f in tests/gpu/test_*_cuda.py; do [[ " $MULTI " == *" $f "* ]] || echo "$f"; done) > "$OUT/gpu_tests.txt" 2>&1
say "suite: $(tail -n 1 "$OUT/gpu_tests.txt")"
grep -hE "^(FAILED|ERROR)|fa4|fa3" "$OUT/gpu_tests.txt" | head -20 | tee -a "$OUT/progress.txt"

say "2: attention kernels, SDPA's default against FlashAttention-4"
PYTHONPATH=$SITE:$PWD timeout 300 python3 benchmarks/attention_kernels.py --seq 65536,262144 --kernels fa4 \
  --out "$OUT/attention" > "$OUT/attention.log" 2>&1
say "attention rc=$?"; grep -h '^{' "$OUT/attention.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['seq'], r['backend'], 'gqa' if r['gqa'] else 'repeat_kv', r.get('error') or
          f\"fwd {r['forward_ms']} ms {r['forward_tflops']} TF/s, bwd {r['backward_ms']} ms {r['backward_tflops']} TF/s, \"
          f\"diff {r.get('max_rel_diff_vs_default', 0):.1e}\")" | tee -a "$OUT/progress.txt"

row() {  # NAME PROBE TREE [capacity.py arguments]; the cap through the config, which both trees read
  local plan_cap=(); [[ $3 == "$PWD" && -n $GPU_GIB ]] && plan_cap=(--gpu-gib "$GPU_GIB")  # the parent's plan too
  PYTHONPATH=$SITE:$3 timeout 300 python3 "$3/benchmarks/capacity.py" --shape llama-3-8b --lora-rank 16 \
    --kernel-breakdown --probes "$2" --budget-s 280 --out "$OUT/rows" --name "$1" "${CAPB[@]}" "${plan_cap[@]}" "${@:4}" 2>&1 \
    | grep -E "^\| (auto|everything) " | tail -1 | tee -a "$OUT/progress.txt"
  say "$1"
}
say "3: 8B LoRA rows"
FA4_RAN=$(grep -c '"backend": "fa4", "gqa": true, [^}]*"forward_ms"' "$OUT/attention.log" 2>/dev/null)
# After: also what is alive at the peak (one more step, not timed): the plan predicts these
# peaks 1.35-1.4x what they measured (21.5 GiB for 15.25 at 64K).
row auto-262144-2L-liger "auto:262144:2:1:2" "$PWD" --peak-breakdown
[ -n "$BEFORE" ] && [ "${LORA_BEFORE:-1}" = 1 ] && row auto-262144-2L-liger-before "auto:262144:2:1:2" "$BEFORE"
[ "${FA4_RAN:-0}" -gt 0 ] && row auto-262144-2L-liger-fa4 "auto:262144:2:1:2" "$PWD" --set attention_kernel=fa4
row auto-65536-32L-liger "auto:65536:32:1:2" "$PWD" --peak-breakdown
# The same row's waits with the host's calls recorded: each copy's size and when it was asked for.
[ "${LAUNCHES:-1}" = 1 ] && row auto-65536-32L-liger-launches "auto:65536:32:1:1" "$PWD" --copy-launches
[ -n "$BEFORE" ] && [ "${LORA_BEFORE:-1}" = 1 ] && row auto-65536-32L-liger-before "auto:65536:32:1:2" "$BEFORE"
[ "${FA4_RAN:-0}" -gt 0 ] && row auto-65536-32L-liger-fa4 "auto:65536:32:1:2" "$PWD" --set attention_kernel=fa4

if [ "${AXOLOTL:-1}" = 1 ] && [ -f benchmarks/axolotl_stack.py ] && [ -d .whl/axolotl ]; then
  say "4: Axolotl's long-context stack"
  for spec in 65536:32 262144:2; do
    PYTHONPATH=$SITE:$PWD timeout 420 python3 benchmarks/axolotl_stack.py --shape llama-3-8b --lora-rank 16 \
      --seq-len "${spec%:*}" --layers "${spec#*:}" --warmup 1 --steps 2 --activation-offloading hidden_states \
      --out "$OUT/axolotl" \
      > "$OUT/axolotl-${spec%:*}.log" 2>&1
    say "axolotl ${spec} rc=$? $(grep -E '^\|' "$OUT/axolotl-${spec%:*}.log" | tail -1)"
  done
fi

say "5: 3B full fine-tune, 16K, fp32 master weights"
PYTHONPATH=$SITE:$PWD timeout 420 python3 benchmarks/full_ft_peers.py --out "$OUT/full-ft" --shapes llama-3.2-3b \
  --modes offloadkit+liger,offloadkit+selective+liger --seq-len 16384 --kernel-breakdown > "$OUT/full_ft.log" 2>&1
say "full ft rc=$?"; grep -E "^\| llama" "$OUT/full_ft.log" | tee -a "$OUT/progress.txt"
# The planner's own choice for it (offload_plan's config through prepare(), full depth).
PYTHONPATH=$SITE:$PWD timeout 300 python3 benchmarks/full_ft_peers.py --out "$OUT/full-ft-plan" --shapes llama-3.2-3b \
  --modes offloadkit_plan --seq-len 16384 --layers 28 --precision fp32_master > "$OUT/full_ft_plan.log" 2>&1
say "planned full ft rc=$?"; grep -E "^\| llama" "$OUT/full_ft_plan.log" | tee -a "$OUT/progress.txt"
if [ "${EVERYTHING:-1}" = 1 ]; then
  say "6: the 16K rows, before and after: 8B LoRA with everything on"
  row everything-16384-32L "everything:16384:32:1:3" "$PWD"
  [ -n "$BEFORE" ] && row everything-16384-32L-before "everything:16384:32:1:3" "$BEFORE"
fi
say "7: the 1B full fine-tune at 16K with checkpoint-input offload, before and after"
for tree in "$PWD:after" ${BEFORE:+"$BEFORE:before"}; do
  (cd "${tree%%:*}" && PYTHONPATH=$SITE:$PWD timeout 200 python3 benchmarks/bench_offload.py --shape llama-3.2-1b \
    --name "llama-3.2-1b-16k-${tree##*:}" --modes "ckpt;ckpt+input_offload" --steps 6 --warmup 2 \
    --out "$OUT/rows-1b" 2>&1 | grep -v -i warn | tail -3 | tee -a "$OUT/progress.txt")
done
if [ "${EDGE:-0}" = 1 ]; then
  # The planner's longest on an H100 (859,136 tokens, 3 layers, everything on: 189 s there with
  # cuDNN, benchmarks/results/longctx/calibrated/h100-7b55b6a/), with each kernel.
  say "8: the 859K edge, 3 layers, cuDNN and FlashAttention-4"
  for kernel in auto fa4; do
    PYTHONPATH=$SITE:$PWD timeout 560 python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 \
      --probes "everything:859136:3:0:1" --budget-s 540 --out "$OUT/rows" --name "edge-859136-3L-$kernel" \
      "${CAPB[@]}" --set "attention_kernel=$kernel" 2>&1 | grep -E "^\| everything " | tail -1 | tee -a "$OUT/progress.txt"
    say "edge $kernel"
  done
fi
if [ "${CP_BREAKDOWN:-1}" = 1 ]; then
  say "9: context parallel on one rank, 795,136 tokens, 1 layer: what is alive at the peak"
  GPU_CAP=(); [[ -n $GPU_GIB ]] && GPU_CAP=(--gpu-gib "$GPU_GIB")
  PYTHONPATH=$SITE:$PWD timeout 420 torchrun --standalone --nproc_per_node 1 benchmarks/context_parallel.py \
    --shape llama-3-8b --lora-rank 16 --tokens-per-gpu 795136 --layers 1 --input-grads "${GPU_CAP[@]}" \
    --rotation alltoall --peak-breakdown --out "$OUT/cp" > "$OUT/cp_one_rank.txt" 2>&1
  say "cp one rank rc=$? $(grep -h -m1 -E '^(RESULT|OOM)' "$OUT/cp_one_rank.txt")"
fi
say "done"
