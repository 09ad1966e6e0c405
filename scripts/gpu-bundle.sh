#!/usr/bin/env bash
# Builds layerserve for the H100 (sm_90a) on a machine without a GPU and
# bundles what the GPU machine needs to run the GPU tests, the CUDA-backend
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
binaries=(
  server/layerserve client/layerctl
  tests/gpu/layer_ops_gpu_test tests/gpu/attention_gpu_test tests/gpu/gemm_test tests/gpu/gemm_pdl_test
  tests/gpu/cuda_backend_test tests/gpu/gemm_router_test tests/gpu/gemm_tuning_test
  tests/gpu/paged_attention_gpu_test tests/gpu/cuda_sessions_test tests/gpu/cuda_graphs_test tests/gpu/moe_gpu_test
  tests/gpu/gemm_silu_gpu_test tests/gpu/gemm_fp8_gpu_test tests/gpu/cuda_fp8_test
  tests/unit/metrics/metrics_cublaslt_test
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
# nginx for the bench-replicas stage (the GPU machine has none): Debian's
# binary with the libraries it links that the GPU machine may lack, run
# through a wrapper that finds them.
if nginx=$(command -v nginx || command -v /usr/sbin/nginx); then
  mkdir -p "$bundle/nginx/lib"
  cp "$nginx" "$bundle/nginx/nginx.bin"
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
tar -C "$bundle" -cf - bin lib python $([[ -d $bundle/nginx ]] && echo nginx) | xz -T2 -6 > .gpubundle/layerserve-gpu.tar.xz
du -sh "$bundle" .gpubundle/layerserve-gpu.tar.xz
