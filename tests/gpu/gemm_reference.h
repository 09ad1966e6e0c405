// Device-side reference pieces for the GEMM tests: a deterministic random
// bf16 fill, a plain fp32 GEMM (no tensor cores, no tiling tricks worth
// sharing a bug with the kernels under test) and an elementwise comparison
// that reports the worst element. Plain C++ header; gemm_reference.cu holds
// the kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace layerserve::kernels::gemm_testing {

// dst[i] = bf16(amplitude * u_i), u_i uniform in [-1, 1) from (seed, i).
cudaError_t FillUniformBf16(void* dst, int64_t count, uint64_t seed, float amplitude, cudaStream_t stream);

// out[m, n] = sum_k float(a[m, k]) * float(w[n, k]) in fp32 (no residual).
cudaError_t ReferenceGemmF32(const void* a, const void* w, float* out, int m, int n, int k, cudaStream_t stream);

struct CompareResult {
  double worst_ratio = 0.0;  // max over elements of |out - ref| / allowed (inf for non-finite out)
  int64_t worst_index = -1;
  float worst_out = 0.f;
  float worst_ref = 0.f;
  int64_t bad_count = 0;  // elements with ratio > 1
};

// Compares bf16 `out` [m, n] against ref (+ bf16 residual, when non-null):
// allowed = rel_tol * |expected| + product_rel_tol * |ref| + abs_tol, where
// product_rel_tol > 0 admits a rounding of the product before the residual is
// added (cuBLASLt's in-place path). Synchronizes `stream`.
cudaError_t CompareBf16(const void* out, const float* ref, const void* residual, int64_t count, float rel_tol,
                        float abs_tol, cudaStream_t stream, CompareResult* result, float product_rel_tol = 0.f);

// bf16 -> float on the host.
float Bf16ToFloat(uint16_t bits);

}  // namespace layerserve::kernels::gemm_testing
