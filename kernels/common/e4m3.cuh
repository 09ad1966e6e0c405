// The activation quantization of the FP8 formats on the device, in one
// place: x at scale s becomes the float8_e4m3fn code of x / s, the quotient
// an IEEE single-precision division (round to nearest even) and the code
// cvt.rn.satfinite's (nearest even, saturating at 448); s == 0 gives zero
// codes. That is what the CPU reference computes (base/dtype.h's
// FloatToFp8E4M3 of x / s), so codes agree bit for bit.
//
// A kernel that quantizes many values at one scale takes the quotient the
// way the hardware's own division takes it on its fast path: the correctly
// rounded reciprocal r = 1/s once per scale, then per value q = x r and one
// fused multiply-add correction, q + (x - q s) r, which is the correctly
// rounded quotient (Markstein's theorem: r within half an ulp of 1/s, q
// within one ulp of x / s, the remainder exact in an fma) wherever nothing
// overflows or goes subnormal. Two fmas and a multiply a value, where the
// division is about ten instructions with its range check and a branch;
// the quotients of a run of values share one branch. The short form is used
// only where it is exact:
//  - `bounded`: |x| <= 448 s, true of a dynamic scale (s = amax / 448 over
//    the same values); a static scale may leave x / s anywhere, and takes
//    the division;
//  - 2^-90 <= s <= 2^100: 1/s is a normal number, and a quotient that
//    matters (at least 2^-11, half the tie point of the smallest subnormal
//    code) comes from an x of at least 2^-101, whose remainder stays normal.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace layerserve::kernels {

inline constexpr float kE4m3MaxValue = 448.f;

class E4m3Scale {
 public:
  __device__ __forceinline__ E4m3Scale(float s, bool bounded)
      : s_(s), fast_(bounded && s >= 0x1p-90f && s <= 0x1p100f) {
#ifdef __CUDA_ARCH__
    r_ = __frcp_rn(s);
#endif
  }

  // The codes of v[0..N) (N a multiple of 4), four to a word, the first in
  // the low byte (memory's order). One branch for all N, so the quotients'
  // arithmetic interleaves.
  template <int N>
  __device__ __forceinline__ void Codes(float (&v)[N], uint32_t (&words)[N / 4]) const {
    static_assert(N % 4 == 0, "codes go four to a word");
    if (s_ == 0.f) {
#pragma unroll
      for (int i = 0; i < N / 4; ++i) words[i] = 0;
      return;
    }
    if (fast_) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float q = v[i] * r_;
        v[i] = fmaf(fmaf(-q, s_, v[i]), r_, q);
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = v[i] / s_;
    }
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      words[i] = uint32_t{Pair(v[4 * i], v[4 * i + 1])} | (uint32_t{Pair(v[4 * i + 2], v[4 * i + 3])} << 16);
    }
  }

 private:
  // Two quotients' codes in one half-word.
  __device__ __forceinline__ static uint16_t Pair(float lo, float hi) {
    return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
  }

  float s_;
  float r_ = 0.f;
  bool fast_;
};

}  // namespace layerserve::kernels
