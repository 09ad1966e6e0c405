// Device code of the element type conversion between the wire/weight dtypes
// (fp32, fp16, bf16): through fp32, rounding to nearest-even like torch's
// .to(). Each thread converts kVec consecutive elements with vector loads
// and stores; the tail of a length that is not a multiple of kVec goes
// element by element.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/dtype.cuh"

namespace layerserve::kernels::cast {

template <typename Src, typename Dst, int kVec>
__global__ void CastKernel(const Src* src, Dst* dst, int64_t n) {
  const int64_t i0 = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kVec;
  if (i0 + kVec <= n) {
    const Vec<Src, kVec> in = *reinterpret_cast<const Vec<Src, kVec>*>(src + i0);
    Vec<Dst, kVec> out;
#pragma unroll
    for (int e = 0; e < kVec; ++e) out.v[e] = FromFloat<Dst>(ToFloat(in.v[e]));
    *reinterpret_cast<Vec<Dst, kVec>*>(dst + i0) = out;
  } else {
    for (int64_t i = i0; i < n; ++i) dst[i] = FromFloat<Dst>(ToFloat(src[i]));
  }
}

}  // namespace layerserve::kernels::cast
