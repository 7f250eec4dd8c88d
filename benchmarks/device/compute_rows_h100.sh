#!/usr/bin/env bash
# On one H100, liger-kernel under /tmp/site (carried as a wheel in .whl/): the compute side's
# rows still owed. First the attention kernels (SDPA's default, FlashAttention-4 where its wheels
# were carried, FlexAttention) at 64K and 256K. The 3B full fine-tune at 16K with fp32 master weights, without and with
# Liger's kernels (benchmarks/full_ft_peers.py); the 8B LoRA r=16, offload_plan: auto, at 64K
# over 32 layers and at 256K over 2, without liger-kernel (auto leaves the layers eager) and
# with it, each with a kernel breakdown (benchmarks/capacity.py --kernel-breakdown). Results
# under $OUT. Run from .snap; longer than one command: start it with setsid, collect $OUT later.
. "$(dirname "$0")/common.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
{ python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name())"
  PYTHONPATH=/tmp/site:$PWD python3 -c "import importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))"
  nvidia-smi -L | head -1; echo "commit ${OFFLOADKIT_COMMIT:-}"; } | tee "$OUT/env.txt"

# FlashAttention-4 and its CuTe DSL (flash-attn-4, nvidia-cutlass-dsl[cu13] with libs-core,
# cuda-bindings, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext, protobuf), when their wheels
# were carried in two calls (.whl/fa4a, .whl/fa4b; the cu13 runtime wheel split over both: one
# carry holds 64 MiB).
if [ -f .whl/fa4a/cu13.part.aa ] && [ -f .whl/fa4b/cu13.part.ab ]; then
  cat .whl/fa4a/cu13.part.aa .whl/fa4b/cu13.part.ab > /tmp/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/fa4a/*.whl .whl/fa4b/*.whl /tmp/nvidia_cutlass_dsl_libs_cu13-*.whl > "$OUT/fa4_install.txt" 2>&1
  say "fa4 install rc=$?"
fi
# The CuTe DSL finds its packages through a .pth file, which a PYTHONPATH entry does not read.
SITE=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages

say "attention kernel option on this GPU (FlashAttention-4 included where it imports)"
PYTHONPATH=$SITE:$PWD timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs \
  tests/gpu/test_attention_kernel_cuda.py > "$OUT/gpu_tests_attention_kernel.txt" 2>&1
say "attention kernel tests: $(tail -n 1 "$OUT/gpu_tests_attention_kernel.txt")"

say "attention kernels: SDPA's default against FlashAttention-4 and FlexAttention, 64K and 256K"
PYTHONPATH=$SITE:$PWD timeout 420 python3 benchmarks/attention_kernels.py --seq 65536,262144 --kernels fa4,flex \
  --out "$OUT/attention" > "$OUT/attention.log" 2>&1
say "attention rc=$?"; grep -h '^{' "$OUT/attention.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['seq'], r['backend'], 'gqa' if r['gqa'] else 'repeat_kv', r.get('error') or
          f\"fwd {r['forward_ms']} ms {r['forward_tflops']} TF/s, bwd {r['backward_ms']} ms {r['backward_tflops']} TF/s, \"
          f\"diff {r.get('max_rel_diff_vs_default', 0):.1e}\")" | tee -a "$OUT/progress.txt"

say "3B full fine-tune, 16K, fp32 master weights"
PYTHONPATH=$SITE:$PWD timeout 420 python3 benchmarks/full_ft_peers.py --out "$OUT/full-ft" --shapes llama-3.2-3b \
  --modes offloadkit,offloadkit+liger,offloadkit+chunked_loss+liger --seq-len 16384 > "$OUT/full_ft.log" 2>&1
say "full ft rc=$?"; grep -E "^\| offloadkit" "$OUT/full_ft.log" | tee -a "$OUT/progress.txt"

row() {  # NAME PROBE with|without [capacity.py arguments]
  local path=$PWD; [ "$3" = with ] && path=$SITE:$PWD
  PYTHONPATH=$path timeout 300 python3 benchmarks/capacity.py --shape llama-3-8b --lora-rank 16 --kernel-breakdown \
    --probes "$2" --budget-s 280 --out "$OUT/rows" --name "$1" "${@:4}" 2>&1 | grep -E "^\| auto" | tail -1 \
    | tee -a "$OUT/progress.txt"
  say "$1"
}
row auto-65536-32L-eager "auto:65536:32:1:2" without
row auto-65536-32L-liger "auto:65536:32:1:2" with
row auto-262144-2L-eager "auto:262144:2:1:2" without
row auto-262144-2L-liger "auto:262144:2:1:2" with
# Where FlashAttention-4 ran in the comparison above: the 256K and 64K rows with it.
if grep -q '"backend": "fa4", "gqa": true, [^}]*"forward_ms"' "$OUT/attention.log" 2>/dev/null; then
  row auto-262144-2L-liger-fa4 "auto:262144:2:1:2" with --set attention_kernel=fa4
  row auto-65536-32L-liger-fa4 "auto:65536:32:1:2" with --set attention_kernel=fa4
fi
say "done"
