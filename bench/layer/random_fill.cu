// FillUniformBf16 (see random_fill.h): one grid-stride pass, one hash per
// element.
#include <cuda_bf16.h>

#include <algorithm>

#include "bench/layer/random_fill.h"
#include "layerserve/kernels/common.h"

namespace layerserve::bench {
namespace {

__device__ __forceinline__ uint64_t SplitMix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void FillUniformBf16Kernel(__nv_bfloat16* dst, int64_t n, uint64_t seed, float center, float half_width) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint64_t bits = SplitMix64(seed ^ (static_cast<uint64_t>(i) * 0xd1b54a32d192ed03ull));
    const float u = static_cast<float>(bits >> 40) * 0x1p-23f - 1.0f;
    dst[i] = __float2bfloat16(center + half_width * u);
  }
}

}  // namespace

absl::Status FillUniformBf16(void* dst, int64_t n, uint64_t seed, float center, float half_width, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 4096);
  FillUniformBf16Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), n,
                                                                                seed, center, half_width);
  LS_CUDA_RETURN_IF_LAUNCH_ERROR(FillUniformBf16Kernel);
  return absl::OkStatus();
}

}  // namespace layerserve::bench
