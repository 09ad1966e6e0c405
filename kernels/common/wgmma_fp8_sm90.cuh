// wgmma wrappers for 8-bit floats: D(64 x N, fp32 registers) (+)= A(64 x 32,
// smem) · B(N x 32, smem)ᵀ with both operands float8_e4m3fn and K-major in
// shared memory (for 8-bit types the instruction has no transpose flags).
// Each 128-byte swizzled row holds 128 K values, so the descriptors are
// wgmma_sm90.cuh's SmemDescSw128 and a k32 step advances them by 32 bytes (2
// descriptor units), as a bf16 k16 step does. `accumulate` false overwrites
// D (the instruction's scale-d predicate), which is how the FP8 GEMM starts
// each 128-wide K block's partial sum before promoting it (FP8.md: the
// tensor cores' FP8 accumulation is not a full FP32 sum).
//
// One function per N the kernels use, each listing one "+f" operand per
// accumulator register; the accumulator layout is the bf16 instruction's
// (wgmma_sm90.cuh). Mechanical, so written out by a short script once; edit
// all of them alike.
#pragma once

#include <cstdint>

#include "kernels/common/sm90_utils.cuh"

namespace layerserve::kernels::gemm {

__device__ __forceinline__ void WgmmaE4m3M64N8(float (&d)[4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if LS_GEMM_DEVICE_SM90A
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3}, "
      "%4, %5, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
#endif
}

__device__ __forceinline__ void WgmmaE4m3M64N16(float (&d)[8], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if LS_GEMM_DEVICE_SM90A
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, "
      "%8, %9, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
#endif
}

__device__ __forceinline__ void WgmmaE4m3M64N32(float (&d)[16], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if LS_GEMM_DEVICE_SM90A
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
#endif
}

__device__ __forceinline__ void WgmmaE4m3M64N64(float (&d)[32], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if LS_GEMM_DEVICE_SM90A
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
#endif
}

__device__ __forceinline__ void WgmmaE4m3M64N128(float (&d)[64], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if LS_GEMM_DEVICE_SM90A
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "
      "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
#endif
}

template <int kN>
__device__ __forceinline__ void WgmmaE4m3M64(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  if constexpr (kN == 8)
    WgmmaE4m3M64N8(d, desc_a, desc_b, accumulate);
  else if constexpr (kN == 16)
    WgmmaE4m3M64N16(d, desc_a, desc_b, accumulate);
  else if constexpr (kN == 32)
    WgmmaE4m3M64N32(d, desc_a, desc_b, accumulate);
  else if constexpr (kN == 64)
    WgmmaE4m3M64N64(d, desc_a, desc_b, accumulate);
  else {
    static_assert(kN == 128, "wgmma e4m3 N not instantiated");
    WgmmaE4m3M64N128(d, desc_a, desc_b, accumulate);
  }
}

}  // namespace layerserve::kernels::gemm
