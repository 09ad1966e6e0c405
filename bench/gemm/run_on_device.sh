#!/bin/bash
# Runs the GEMM test suite (one process per version, so a failing kernel
# cannot take the others down) and the benchmark on the GPU machine, from a
# bundle made here by bundle_for_device.sh. Logs go to $OUT (or ./gemm-out).
#   bench/gemm/run_on_device.sh [bench args...]
set -u -o pipefail
BUNDLE=${BUNDLE:-build-gemm/run}
OUT=${OUT:-gemm-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/$BUNDLE/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/device.txt"
if command -v cuobjdump >/dev/null; then
  cuobjdump -sass "$BUNDLE/gemm_bench" > "$OUT/sass_full.txt" 2>&1
  for op in HGMMA HMMA LDL STL SETMAXREG UTMALDG SYNCS; do
    echo "$op: $(grep -c "$op" "$OUT/sass_full.txt")"
  done | tee -a "$OUT/device.txt"
  rm -f "$OUT/sass_full.txt"
fi
: > "$OUT/test.log"
for v in v0_cublaslt v1_mma_sync v2_tma_wgmma v3_bn256 v3_bn128 v4_split_auto v4_split_1 v4_split_3 v4_split_8 v5_cluster_multicast dispatcher; do
  start=$SECONDS
  timeout 120 "$BUNDLE/gemm_test" --gtest_filter="*MatchesReference/$v" >> "$OUT/test.log" 2>&1
  rc=$?
  printf 'test %-22s rc=%d  %ss  worst ratio %s\n' "$v" "$rc" "$((SECONDS - start))" \
    "$(grep "^\[$v\]" "$OUT/test.log" | sed 's/.*allowed=\([^ ]*\).*/\1/' | sort -g | tail -1)" | tee -a "$OUT/summary.txt"
done
timeout 120 "$BUNDLE/gemm_test" --gtest_filter="GemmDispatcherTest.*" >> "$OUT/test.log" 2>&1
echo "test dispatcher-autotune rc=$?" | tee -a "$OUT/summary.txt"
grep "^\[autotune\]" "$OUT/test.log" | tee -a "$OUT/summary.txt"
grep -E "FAILED|Failure|error" "$OUT/test.log" | head -20
timeout 300 "$BUNDLE/gemm_bench" --csv="$OUT/bench.csv" "$@" 2>&1 | tee "$OUT/bench.txt"
echo "bench rc=$?"
