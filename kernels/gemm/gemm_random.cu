// Random bf16 fill used by the dispatcher's autotune pass: timings on zeros
// flatter the tensor cores, so candidates are timed on uniform [-1, 1) data;
// and a constant float fill for an FP8 pass's block scales.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/gemm/gemm_internal.h"

namespace layerserve::kernels::gemm {
namespace {

__global__ void FillRandomBf16Kernel(__nv_bfloat16* dst, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // splitmix64 of (seed, index): independent of the launch shape.
    uint64_t z = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    dst[i] = __float2bfloat16_rn(2.f * u - 1.f);
  }
}

__global__ void FillFloatKernel(float* dst, int64_t n, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = value;
  }
}

}  // namespace

absl::Status FillFloat(float* dst, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 1024);
  FillFloatKernel<<<static_cast<int>(blocks), 256, 0, stream>>>(dst, n, value);
  LS_CUDA_RETURN_IF_LAUNCH_ERROR(FillFloatKernel);
  return absl::OkStatus();
}

absl::Status FillRandomBf16(void* dst, int64_t n, uint64_t seed, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 4096);
  FillRandomBf16Kernel<<<static_cast<int>(blocks), 256, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), n, seed);
  LS_CUDA_RETURN_IF_LAUNCH_ERROR(FillRandomBf16Kernel);
  return absl::OkStatus();
}

}  // namespace layerserve::kernels::gemm
