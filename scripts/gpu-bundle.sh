#!/usr/bin/env bash
# Builds layerserve for the H100 (sm_90a) on a machine without a GPU and
# bundles what the GPU machine needs to run the GPU tests (the ctest label
# "gpu", listed in the bundle's gpu-tests.txt), the CUDA-backend
# integration suite and the benchmarks into .gpubundle/layerserve-gpu.tar.xz
# (git-ignored; ~20 MB, to stay well inside what a transfer may carry): the
# binaries, stripped of debug info, and the non-system shared libraries they
# link (gRPC, protobuf, Abseil, OpenBLAS, prometheus-cpp; not libc, libstdc++
# or CUDA, which the GPU machine has), and the pure-Python prometheus_client
# that bench/server reads /metrics with (the GPU machine's Python has no pip
# packages beyond PyTorch and transformers).
# Then, on the GPU machine, from the repository root: scripts/gpu-run.sh.
#   usage: scripts/gpu-bundle.sh [build dir, default build]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$LAYERSERVE_ROOT"
build=${1:-build}
bundle=$build/gpubundle

LAYERSERVE_BUILD_DIR="$LAYERSERVE_ROOT/$build" bash scripts/build.sh \
  -DLAYERSERVE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib"
# The GPU tests are the binaries of every test with the ctest label "gpu"
# (LABELS gpu in tests/gpu/CMakeLists.txt and its fragments). The GPU machine
# has no ctest, so their names go into the bundle as gpu-tests.txt, the list
# scripts/gpu-run.sh runs.
mapfile -t gpu_tests < <(ctest --test-dir "$build" -L '^gpu$' --show-only=json-v1 |
  "$PYTHON" -c '
import json, os, sys
build = os.path.realpath(sys.argv[1])
seen = []
for test in json.load(sys.stdin)["tests"]:
    binary = os.path.relpath(os.path.realpath(test["command"][0]), build)
    if binary not in seen:
        seen.append(binary)
print("\n".join(seen))' "$build")
if [[ ${#gpu_tests[@]} -eq 0 || -z ${gpu_tests[0]} ]]; then
  echo "no test in $build carries the ctest label gpu" >&2
  exit 1
fi
binaries=(
  server/layerserve client/layerctl
  "${gpu_tests[@]}"
  bench/attention/flash_attention_bench bench/attention/decode_attention_bench bench/gemm/gemm_bench
  bench/layer/layer_bench bench/grpc/grpc_echo
)
for test in "$build"/tests/integration/integration_*_test; do
  binaries+=("${test#"$build"/}")
done
for b in "${binaries[@]}"; do
  strip --strip-debug -o "$bundle/bin/$(basename "$b")" "$build/$b"
done
for b in "$bundle"/bin/*; do
  ldd "$b" | awk '/=> \// {print $3}' |
    grep -v -E '/(libc|libm|libgcc_s|libstdc\+\+|libpthread|libdl|librt|ld-linux[^/]*)\.so|libcuda|libcublas|libcudart' |
    xargs -r -I{} cp -L -n {} "$bundle/lib/"
done
for t in "${gpu_tests[@]}"; do basename "$t"; done > "$bundle/gpu-tests.txt"
# nginx for the bench-replicas stage (the GPU machine has none): Debian's
# binary with the libraries it links that the GPU machine may lack, run
# through a wrapper that finds them, and the stream module the shipped
# configuration loads (tests/support/nginx_proxy.py finds it in modules/).
if nginx=$(command -v nginx || command -v /usr/sbin/nginx); then
  mkdir -p "$bundle/nginx/lib" "$bundle/nginx/modules"
  cp "$nginx" "$bundle/nginx/nginx.bin"
  cp /usr/lib/nginx/modules/ngx_stream_module.so "$bundle/nginx/modules/"
  ldd "$nginx" | awk '/=> \// {print $3}' |
    grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
    xargs -r -I{} cp -L -n {} "$bundle/nginx/lib/"
  cat > "$bundle/nginx/nginx" << 'WRAPPER'
#!/usr/bin/env bash
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/nginx.bin" "$@"
WRAPPER
  chmod +x "$bundle/nginx/nginx"
fi
mkdir -p "$bundle/python"
cp -r "$("$PYTHON" -c 'import os, prometheus_client; print(os.path.dirname(prometheus_client.__file__))')" \
  "$bundle/python/"
find "$bundle/python" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p .gpubundle
tar -C "$bundle" -cf - bin lib python gpu-tests.txt $([[ -d $bundle/nginx ]] && echo nginx) | xz -T2 -6 > .gpubundle/layerserve-gpu.tar.xz
du -sh "$bundle" .gpubundle/layerserve-gpu.tar.xz
