// Device code of the SwiGLU gate: out = silu(gate) * up over rows whose gate
// and up columns are interleaved in blocks of p.block (kGateUpBlock = 8, or
// an FP8 gate/up's 64), one 16-byte vector of 8 outputs per thread: output
// vector c lies in interleave block b = 8 c / p.block, its gate at vector
// (2 b p.block + 8 c mod p.block) / 8 of the row and its up p.block / 8
// vectors later. The GEMM epilogue that fuses this (SiluMulOne in
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
  static_assert(kVec == kGateUpBlock, "a vector never straddles an interleave block");
  const int64_t block_vecs = p.block / kVec;
  const int64_t gate = (col / block_vecs) * 2 * block_vecs + col % block_vecs;
  const V g = in[gate];
  const V u = in[gate + block_vecs];
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
