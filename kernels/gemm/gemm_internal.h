// Host-side pieces shared by the GEMM launchers (gemm_v*.cu), LaunchGemm
// (gemm_launch.cc) and the dispatcher: device queries, TMA descriptor
// encoding through the driver entry point, split-K sizing, and the
// per-version launch functions. Plain C++ (no nvcc needed).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layerserve/kernels/gemm.h"

namespace layerserve::kernels::gemm {

// Returns from the enclosing function if the absl::Status expression fails.
#define LS_GEMM_RETURN_IF_ERROR(expr)           \
  do {                                          \
    ::absl::Status ls_gemm_status_ = (expr);    \
    if (!ls_gemm_status_.ok()) return ls_gemm_status_; \
  } while (0)

struct DeviceInfo {
  int num_sms = 0;
  int cc_major = 0;
  int cc_minor = 0;
  int max_smem_optin = 0;  // bytes of dynamic shared memory a block may opt into
};
absl::StatusOr<DeviceInfo> CurrentDeviceInfo();

// True if this library was built with sm_90a device code (wgmma, setmaxnreg).
bool BuiltWithSm90a();

// Tensor map over a row-major bf16 matrix [rows, cols] (cols contiguous),
// boxes of box_rows x 64 columns (128 bytes: one 128B-swizzle row), zero fill
// outside the matrix. Remembered per thread by its arguments, so repeated
// launches on the same buffers and M skip the encode.
absl::StatusOr<CUtensorMap> MakeBf16TensorMap(const void* base, int64_t rows, int64_t cols, int box_rows);

// Version 4 sizing. Token count padded to the wgmma N the kernel uses.
int SmallMPad(int64_t m);
// Version 4 splits K at most this many ways (the portable cluster size).
inline constexpr int kMaxSplitK = 8;
// Default splits of K for (n, k) on `num_sms` SMs.
int SplitKHeuristic(int64_t n, int64_t k, int num_sms);

// Per-version launchers; params already validated by LaunchGemm.
absl::Status LaunchGemmV3(const GemmParams& p, int block_n, const DeviceInfo& dev, cudaStream_t stream);
// Version 3 tile width for block_n = 0: 256 unless 128 fills the SMs' last
// wave clearly better.
int AutoBlockNV3(int64_t m, int64_t n, int num_sms);
absl::Status LaunchGemmV4(const GemmParams& p, int splits, const DeviceInfo& dev, cudaStream_t stream);
absl::Status LaunchGemmV5(const GemmParams& p, const DeviceInfo& dev, cudaStream_t stream);

// Fills n bf16 elements with uniform values in [-1, 1) from `seed` (the
// dispatcher's autotune data: never time on zeros).
absl::Status FillRandomBf16(void* dst, int64_t n, uint64_t seed, cudaStream_t stream);

}  // namespace layerserve::kernels::gemm
