// Device code of the SwiGLU gate: out = silu(gate) * up over rows whose gate
// and up columns are interleaved in blocks of 8 (kGateUpBlock), one 16-byte
// vector of 8 outputs per thread: vector 2c of a row is gate block c, vector
// 2c + 1 the up block. The GEMM epilogue that fuses this (SiluMulOne in
// kernels/gemm/gemm_sm90_epilogue.cuh) rounds the same way.
// Rounding follows the two T ops of Hugging Face's act_fn(gate) * up: silu's
// result is rounded to T, then the product is.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/dtype.cuh"
#include "kernels/common/pdl.cuh"
#include "layerserve/kernels/layer_ops.h"

namespace layerserve::kernels::activation {

template <typename T>
__global__ void SiluMulKernel(const SiluMulParams p) {
  AllowDependentLaunch();  // down_proj may start streaming its weights
  constexpr int kVec = kVec16<T>;
  using V = Vec<T, kVec>;
  const int64_t vecs_per_row = p.width / kVec;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (idx >= p.rows * vecs_per_row) return;
  const int64_t row = idx / vecs_per_row;
  const int64_t col = idx % vecs_per_row;
  const V* in = static_cast<const V*>(p.gate_up) + row * 2 * vecs_per_row;
  static_assert(kVec == kGateUpBlock, "one vector per interleaved block");
  const V g = in[2 * col];
  const V u = in[2 * col + 1];
  V out;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float x = ToFloat(g.v[e]);
    const float silu = RoundTo<T>(x / (1.f + expf(-x)));
    out.v[e] = FromFloat<T>(silu * ToFloat(u.v[e]));
  }
  static_cast<V*>(p.out)[row * vecs_per_row + col] = out;
}

}  // namespace layerserve::kernels::activation
