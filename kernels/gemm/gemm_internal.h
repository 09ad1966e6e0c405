// Host-side pieces behind the GEMM router (gemm_router.cc), LaunchGemm
// (gemm_launch.cc) and the per-version launchers (gemm_v*.cu): the dense
// problem our kernels take, TMA descriptor encoding through the driver entry
// point, and the per-version launch functions (their sizing rules are in
// gemm_heuristics.h). Plain C++ (no nvcc needed).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layerserve/kernels/gemm.h"

namespace layerserve::kernels::gemm {

// What our kernels compute: C = A·Wᵀ (+ R), dense row-major bf16 (row strides
// k, k, n, n), R optional and allowed to alias C (the kernels read each
// residual element in the thread that writes its output). LaunchGemm builds
// it from GemmParams with R = D when accumulating.
struct DenseGemm {
  const void* a = nullptr;         // [m, k]
  const void* w = nullptr;         // [n, k]
  const void* residual = nullptr;  // [m, n] or null
  const void* bias = nullptr;      // [n] or null: version 6 only (GemmParams::bias)
  void* c = nullptr;               // [m, n]
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  // Grouped products (GemmParams::group_offsets): w is [groups n, k].
  const int32_t* group_offsets = nullptr;
  int groups = 0;
  int64_t max_group_rows = 0;
  // C = silu(gate) * up of the product's interleaved columns, [m, n / 2]
  // (GemmParams::silu_mul); no residual then.
  bool silu_mul = false;
  // FP8 products (version 6): a and w are e4m3 codes, scaled as GemmParams
  // says.
  Fp8Scaling fp8 = Fp8Scaling::kNone;
  const float* a_scale = nullptr;
  const float* w_scale = nullptr;
};

// Tensor map over a row-major bf16 matrix [rows, cols] (cols contiguous),
// boxes of box_rows x 64 columns (128 bytes: one 128B-swizzle row), zero fill
// outside the matrix. Remembered per thread by its arguments, so repeated
// launches on the same buffers and M skip the encode.
absl::StatusOr<CUtensorMap> MakeBf16TensorMap(const void* base, int64_t rows, int64_t cols, int box_rows);

// The same over e4m3 codes: boxes of box_rows x 128 (one 128-byte row).
absl::StatusOr<CUtensorMap> MakeFp8TensorMap(const void* base, int64_t rows, int64_t cols, int box_rows);

// Version 4 splits K at most this many ways (the portable cluster size).
inline constexpr int kMaxSplitK = 8;

// Per-version launchers; the problem already checked by GemmSupported.
absl::Status LaunchGemmV3(const DenseGemm& p, int block_n, int block_m, const DeviceInfo& dev, cudaStream_t stream);
absl::Status LaunchGemmV4(const DenseGemm& p, int splits, const DeviceInfo& dev, cudaStream_t stream);
absl::Status LaunchGemmV6(const DenseGemm& p, int splits, int block_m, const DeviceInfo& dev, cudaStream_t stream);
absl::Status LaunchGemmV5(const DenseGemm& p, const DeviceInfo& dev, cudaStream_t stream);

// Fills n bf16 elements with uniform values in [-1, 1) from `seed` (the
// autotune data: never time on zeros).
absl::Status FillRandomBf16(void* dst, int64_t n, uint64_t seed, cudaStream_t stream);
// dst[0, n) = value (an FP8 tuning pass's block scales).
absl::Status FillFloat(float* dst, int64_t n, float value, cudaStream_t stream);

}  // namespace layerserve::kernels::gemm
