// Kernels behind gemm_reference.h (see there).
#include "tests/gpu/gemm_reference.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace layerserve::kernels::gemm_testing {
namespace {

__global__ void FillKernel(__nv_bfloat16* dst, int64_t count, uint64_t seed, float amplitude) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = (seed + 1) * 0xD1B54A32D192ED03ull + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
    dst[i] = __float2bfloat16_rn(amplitude * (2.f * u - 1.f));
  }
}

// 64x64 output tile per block, 16x16 threads with 4x4 outputs each, k in
// steps of 16 through shared memory.
__global__ void RefGemmKernel(const __nv_bfloat16* a, const __nv_bfloat16* w, float* out, int m, int n, int k) {
  __shared__ float as[16][65];
  __shared__ float ws[16][65];
  const int tx = threadIdx.x % 16;
  const int ty = threadIdx.x / 16;
  const int m0 = blockIdx.y * 64;
  const int n0 = blockIdx.x * 64;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < k; k0 += 16) {
    for (int i = threadIdx.x; i < 64 * 16; i += 256) {
      const int row = i / 16;
      const int kk = i % 16;
      const bool k_ok = k0 + kk < k;
      as[kk][row] = (k_ok && m0 + row < m) ? __bfloat162float(a[static_cast<int64_t>(m0 + row) * k + k0 + kk]) : 0.f;
      ws[kk][row] = (k_ok && n0 + row < n) ? __bfloat162float(w[static_cast<int64_t>(n0 + row) * k + k0 + kk]) : 0.f;
    }
    __syncthreads();
    for (int kk = 0; kk < 16; ++kk) {
      float av[4], wv[4];
      for (int i = 0; i < 4; ++i) av[i] = as[kk][ty + 16 * i];
      for (int j = 0; j < 4; ++j) wv[j] = ws[kk][tx + 16 * j];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], wv[j], acc[i][j]);
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      const int row = m0 + ty + 16 * i;
      const int col = n0 + tx + 16 * j;
      if (row < m && col < n) out[static_cast<int64_t>(row) * n + col] = acc[i][j];
    }
}

struct Worst {
  double ratio;
  int64_t index;
  int64_t bad;
};

__global__ void CompareKernel(const __nv_bfloat16* out, const float* ref, const __nv_bfloat16* residual, int64_t count,
                              float rel_tol, float abs_tol, float product_rel_tol, Worst* per_block) {
  double worst = 0.0;
  int64_t worst_index = -1;
  int64_t bad = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float expected = ref[i] + (residual != nullptr ? __bfloat162float(residual[i]) : 0.f);
    const float got = __bfloat162float(out[i]);
    const double allowed = rel_tol * fabsf(expected) + product_rel_tol * fabsf(ref[i]) + abs_tol;
    const double ratio = isfinite(got) ? fabs(static_cast<double>(got) - expected) / allowed : INFINITY;
    if (ratio > 1.0) ++bad;
    if (ratio > worst || worst_index < 0) {
      worst = ratio;
      worst_index = i;
    }
  }
  __shared__ Worst block[256];
  block[threadIdx.x] = Worst{worst, worst_index, bad};
  __syncthreads();
  if (threadIdx.x == 0) {
    Worst w = block[0];
    for (int t = 1; t < blockDim.x; ++t) {
      w.bad += block[t].bad;
      if (block[t].index >= 0 && (block[t].ratio > w.ratio || w.index < 0)) {
        w.ratio = block[t].ratio;
        w.index = block[t].index;
      }
    }
    per_block[blockIdx.x] = w;
  }
}

}  // namespace

cudaError_t FillUniformBf16(void* dst, int64_t count, uint64_t seed, float amplitude, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, 4096));
  FillKernel<<<std::max(blocks, 1), 256, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), count, seed, amplitude);
  return cudaPeekAtLastError();
}

cudaError_t ReferenceGemmF32(const void* a, const void* w, float* out, int m, int n, int k, cudaStream_t stream) {
  const dim3 grid((n + 63) / 64, (m + 63) / 64);
  RefGemmKernel<<<grid, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(w),
                                          out, m, n, k);
  return cudaPeekAtLastError();
}

cudaError_t CompareBf16(const void* out, const float* ref, const void* residual, int64_t count, float rel_tol,
                        float abs_tol, cudaStream_t stream, CompareResult* result, float product_rel_tol) {
  constexpr int kBlocks = 1024;
  Worst* per_block = nullptr;
  cudaError_t err = cudaMalloc(&per_block, kBlocks * sizeof(Worst));
  if (err != cudaSuccess) return err;
  CompareKernel<<<kBlocks, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(out), ref,
                                             static_cast<const __nv_bfloat16*>(residual), count, rel_tol, abs_tol,
                                             product_rel_tol, per_block);
  std::vector<Worst> host(kBlocks);
  err = cudaPeekAtLastError();
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(host.data(), per_block, kBlocks * sizeof(Worst), cudaMemcpyDeviceToHost, stream);
  }
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  cudaFree(per_block);
  if (err != cudaSuccess) return err;
  CompareResult r;
  for (const Worst& w : host) {
    r.bad_count += w.bad;
    if (w.index >= 0 && (w.ratio > r.worst_ratio || r.worst_index < 0)) {
      r.worst_ratio = w.ratio;
      r.worst_index = w.index;
    }
  }
  if (r.worst_index >= 0) {
    uint16_t out_bits = 0, res_bits = 0;
    float ref_value = 0.f;
    err = cudaMemcpy(&out_bits, static_cast<const uint16_t*>(out) + r.worst_index, 2, cudaMemcpyDeviceToHost);
    if (err == cudaSuccess) err = cudaMemcpy(&ref_value, ref + r.worst_index, 4, cudaMemcpyDeviceToHost);
    if (err == cudaSuccess && residual != nullptr) {
      err = cudaMemcpy(&res_bits, static_cast<const uint16_t*>(residual) + r.worst_index, 2, cudaMemcpyDeviceToHost);
    }
    if (err != cudaSuccess) return err;
    r.worst_out = Bf16ToFloat(out_bits);
    r.worst_ref = ref_value + (residual != nullptr ? Bf16ToFloat(res_bits) : 0.f);
  }
  *result = r;
  return cudaSuccess;
}

float Bf16ToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

}  // namespace layerserve::kernels::gemm_testing
