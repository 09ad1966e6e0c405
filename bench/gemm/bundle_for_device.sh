#!/bin/bash
# Copies gemm_test, gemm_bench and the non-system shared libraries they need
# into build-gemm/run (git-ignored), the folder to name in the device tool's
# carry list for run_on_device.sh. Argument: the build directory of the main
# tree (default build-gemm).
set -eu
BUILD=${1:-build-gemm}
RUN=$BUILD/run
rm -rf "$RUN" && mkdir -p "$RUN/lib"
cp "$BUILD/tests/gpu/gemm_test" "$BUILD/bench/gemm/gemm_bench" "$RUN/"
for bin in "$RUN/gemm_test" "$RUN/gemm_bench"; do
  ldd "$bin" | awk '/=>/ {print $3}' |
    grep -v -E 'libc\.so|libm\.so|ld-linux|libgcc|libstdc|libpthread|libdl|librt|cuda|cublas' |
    xargs -r -I{} cp -n {} "$RUN/lib/"
done
du -sh "$RUN"
