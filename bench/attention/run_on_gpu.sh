#!/usr/bin/env bash
# Runs on the GPU machine (device tool): the kernel tests, then the attention
# and layer-op benchmarks against PyTorch, each log written under $OUT.
# Expects the binaries built on the dev machine and staged (with the
# non-system shared libraries they need, in lib/) by stage_for_gpu.sh.
#   usage: bench/attention/run_on_gpu.sh [staged-dir]   (default build-gpu/dev)
set -u
BIN=${1:-build-gpu/dev}
OUT=${OUT:-/tmp/layerserve-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$BIN/lib:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv \
  > "$OUT/nvidia_smi.txt" 2>&1
for t in layer_ops_gpu_test attention_gpu_test; do
  start=$(date +%s)
  "$BIN/$t" --gtest_brief=1 --gtest_output="xml:$OUT/$t.xml" > "$OUT/$t.log" 2>&1
  echo "$t: rc=$? in $(( $(date +%s) - start ))s; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$t.log" | tr '\n' ' ')"
done
# Twice: the spread between the two runs is the noise floor of a comparison.
"$BIN/flash_attention_bench" > "$OUT/bench.log" 2>&1
echo "flash_attention_bench rc=$?"
"$BIN/flash_attention_bench" > "$OUT/bench_repeat.log" 2>&1
echo "flash_attention_bench (repeat) rc=$?"
python3 bench/attention/torch_sdpa.py > "$OUT/torch_sdpa.log" 2>&1
echo "torch_sdpa.py rc=$?"
# SASS of the kernels, to check offline for HMMA/LDSM and local-memory spills.
cuobjdump -sass "$BIN/flash_attention_bench" > "$OUT/kernels.sass" 2>&1
cat "$OUT/nvidia_smi.txt"
grep -h -B2 -A12 -E 'Failure|FAILED  ]' "$OUT"/*_test.log | head -60
rm -f "$OUT/layer_ops_gpu_test.xml"  # only the attention errors are kept
cat "$OUT/bench.log" "$OUT/torch_sdpa.log"
grep -E '^(1x|4x|8x|mix)' "$OUT/bench_repeat.log"
