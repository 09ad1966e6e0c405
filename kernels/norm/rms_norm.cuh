// Device code of RMSNorm fused with the residual add.
//
// A "row group" of kWarpsPerRow warps normalizes one row: one warp for narrow
// rows (several rows per CTA), a whole CTA for wide ones. Pass 1 forms
// h = x + residual with 16-byte loads, writes it out and parks it in shared
// memory while summing h^2 in fp32; pass 2 reads h back (each thread touches
// only the vectors it wrote, so no barrier is needed for the parked row) and
// writes y. Rounding follows Hugging Face's LlamaRMSNorm in 16-bit models:
// h is rounded to T (the residual add is a T op), h * rsqrt(mean(h^2) + eps)
// is rounded to T, and so is weight * that.
//
// With an FP8 output (RmsNormParams::fp8_codes, bf16 rows) y is quantized in
// the same kernel, as LaunchQuantizeFp8 of y would quantize it: per 128-column
// group (the 16 lanes holding a group's 16 vectors reduce its amax by
// shuffles), or per row (pass 2 parks y and reduces the row's amax, a third
// pass writes the codes), or at a static scale.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/dtype.cuh"
#include "kernels/common/e4m3.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/common/reduce.cuh"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels::norm {

// The kVec values of `v` as e4m3 codes at `dst`, at `scale`
// (kernels/common/e4m3.cuh, as LaunchQuantizeFp8 quantizes).
template <typename V>
__device__ __forceinline__ void Fp8Store(const V& v, const E4m3Scale& scale, uint8_t* dst) {
  constexpr int kVec = sizeof(v.v) / sizeof(v.v[0]);
  static_assert(kVec % 4 == 0, "codes are stored four at a time");
  float x[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) x[e] = ToFloat(v.v[e]);
  uint32_t words[kVec / 4];
  scale.Codes(x, words);
#pragma unroll
  for (int e = 0; e < kVec / 4; ++e) *reinterpret_cast<uint32_t*>(dst + 4 * e) = words[e];
}

template <typename T, int kWarpsPerRow, int kWarpsPerBlock>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) RmsNormKernel(const RmsNormParams p) {
  static_assert(kWarpsPerBlock % kWarpsPerRow == 0, "a CTA holds whole row groups");
  AllowDependentLaunch();      // the GEMM after the norm may start streaming its weights
  WaitForPrerequisiteGrids();  // launched as a dependent: x is complete past here
  constexpr int kRowsPerBlock = kWarpsPerBlock / kWarpsPerRow;
  constexpr int kThreadsPerRow = kWarpsPerRow * 32;
  constexpr int kVec = kVec16<T>;
  using V = Vec<T, kVec>;

  extern __shared__ __align__(16) unsigned char smem_raw[];  // [kRowsPerBlock][cols] of T
  __shared__ float warp_sums[kWarpsPerBlock];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = warp / kWarpsPerRow;
  const int t = threadIdx.x % kThreadsPerRow;
  const int64_t row = int64_t{blockIdx.x} * kRowsPerBlock + group;
  // Rows past the end still reach the barrier below; they just do no work.
  const bool active = row < p.rows;
  const int64_t nvec = p.cols / kVec;
  V* parked = reinterpret_cast<V*>(smem_raw) + group * nvec;

  float sum_sq = 0.f;
  if (active) {
    const V* x = static_cast<const V*>(p.x) + row * nvec;
    const V* res = p.residual != nullptr ? static_cast<const V*>(p.residual) + row * nvec : nullptr;
    V* h_out = res != nullptr ? static_cast<V*>(p.h_out) + row * nvec : nullptr;
    for (int64_t i = t; i < nvec; i += kThreadsPerRow) {
      V h = x[i];
      if (res != nullptr) {
        const V r = res[i];
#pragma unroll
        for (int e = 0; e < kVec; ++e) h.v[e] = FromFloat<T>(ToFloat(h.v[e]) + ToFloat(r.v[e]));
        h_out[i] = h;  // may alias x or residual: element i was read above
      }
      parked[i] = h;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float f = ToFloat(h.v[e]);
        sum_sq += f * f;
      }
    }
  }
  sum_sq = WarpReduceSum(sum_sq);
  if constexpr (kWarpsPerRow > 1) {
    if (lane == 0) warp_sums[warp] = sum_sq;
    __syncthreads();
    sum_sq = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsPerRow; ++w) sum_sq += warp_sums[group * kWarpsPerRow + w];
  }
  if (!active) return;

  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(p.cols) + p.eps);
  const V* weight = static_cast<const V*>(p.weight);
  V* y = static_cast<V*>(p.y) + row * nvec;
  const bool fp8 = p.fp8_codes != nullptr;
  const bool fp8_groups = fp8 && p.fp8_group > 0;
  float amax = 0.f;  // of the row's y, for per-row FP8 scales
  for (int64_t i = t; i < nvec; i += kThreadsPerRow) {
    const V h = parked[i];
    const V w = weight[i];
    V out;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      out.v[e] = FromFloat<T>(ToFloat(w.v[e]) * RoundTo<T>(ToFloat(h.v[e]) * inv_rms));
    }
    y[i] = out;
    if (!fp8) continue;
    if (fp8_groups) {
      // Vectors 16 g .. 16 g + 15 (one 128-column group) are in 16 lanes of
      // this warp, all of them in this pass (cols % 128 == 0).
      float group_amax = 0.f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) group_amax = fmaxf(group_amax, fabsf(ToFloat(out.v[e])));
      const unsigned half = lane < 16 ? 0x0000FFFFu : 0xFFFF0000u;
#pragma unroll
      for (int offset = 8; offset > 0; offset /= 2) {
        group_amax = fmaxf(group_amax, __shfl_xor_sync(half, group_amax, offset));
      }
      const float s = group_amax / kE4m3MaxValue;
      Fp8Store(out, E4m3Scale(s, true), static_cast<uint8_t*>(p.fp8_codes) + (row * nvec + i) * kVec);
      if (i % 16 == 0) p.fp8_scales[(i / 16) * p.rows + row] = s;
    } else {
      parked[i] = out;
#pragma unroll
      for (int e = 0; e < kVec; ++e) amax = fmaxf(amax, fabsf(ToFloat(out.v[e])));
    }
  }
  if (!fp8 || fp8_groups) return;

  // Per row: the row's amax (or the static scale), then its codes.
  float s = p.fp8_static_scale;
  if (!(s > 0.f)) {
    amax = WarpReduceMax(amax);
    if constexpr (kWarpsPerRow > 1) {
      __syncthreads();  // every warp has read warp_sums (pass 1)
      if (lane == 0) warp_sums[warp] = amax;
      __syncthreads();
      amax = 0.f;
#pragma unroll
      for (int w = 0; w < kWarpsPerRow; ++w) amax = fmaxf(amax, warp_sums[group * kWarpsPerRow + w]);
    }
    s = amax / kE4m3MaxValue;
  }
  const E4m3Scale scale(s, !(p.fp8_static_scale > 0.f));
  for (int64_t i = t; i < nvec; i += kThreadsPerRow) {
    Fp8Store(parked[i], scale, static_cast<uint8_t*>(p.fp8_codes) + (row * nvec + i) * kVec);
  }
  if (t == 0) p.fp8_scales[row] = s;
}

}  // namespace layerserve::kernels::norm
