#!/usr/bin/env bash
# Stages the GPU test and benchmark binaries of a build dir, plus the shared
# libraries they need that the GPU machine lacks (Debian's absl, cudart), into
# BUILD/dev, the one folder the device run carries.
#   usage: bench/attention/stage_for_gpu.sh [build-dir]   (default build-gpu)
set -eu
BUILD=${1:-build-gpu}
DEV="$BUILD/dev"
rm -rf "$DEV"
mkdir -p "$DEV/lib"
cp "$BUILD/tests/gpu/layer_ops_gpu_test" "$BUILD/tests/gpu/attention_gpu_test" \
   "$BUILD/bench/attention/flash_attention_bench" "$DEV/"
for bin in "$DEV"/*_test "$DEV"/*_bench; do
  ldd "$bin" | awk '/=> \// {print $3}' \
    | grep -v -E '/(libc|libm|libgcc_s|libstdc\+\+|libpthread|libdl|librt|ld-linux[^/]*)\.so' \
    | xargs -r -I{} cp -L -n {} "$DEV/lib/"
done
du -sh "$DEV"
