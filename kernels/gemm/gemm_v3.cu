// Host launcher of version 3 (gemm_v3_warp_specialized_sm90.cuh): tensor maps
// for A (block_m-row boxes: 128, or 64 for grouped products of small groups)
// and W (block_n-row boxes), one persistent CTA per SM
// (fewer when there are fewer tiles, or at most that many for a grouped
// product).
#include <algorithm>
#include <cstdint>

#include "kernels/gemm/gemm_internal.h"
#include "kernels/gemm/gemm_v3_warp_specialized_sm90.cuh"

namespace layerserve::kernels::gemm {
namespace {

template <int kBlockN, int kBlockM>
absl::Status Launch(const DenseGemm& p, const DeviceInfo& dev, cudaStream_t stream) {
  using C = v3::Config<kBlockN, kBlockM>;
  const GemmArgs args = MakeGemmArgs(p, kBlockM, kBlockN);
  absl::StatusOr<CUtensorMap> map_a = MakeBf16TensorMap(p.a, p.m, p.k, kBlockM);
  if (!map_a.ok()) return map_a.status();
  // A grouped product's W is every group's, stacked.
  const int64_t w_rows = p.group_offsets != nullptr ? p.groups * p.n : p.n;
  absl::StatusOr<CUtensorMap> map_w = MakeBf16TensorMap(p.w, w_rows, p.k, kBlockN);
  if (!map_w.ok()) return map_w.status();
  if (dev.max_smem_optin < C::kSmemBytes) return absl::ResourceExhaustedError("gemm v3: not enough shared memory");
  LS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(v3::GemmWarpSpecializedKernel<kBlockN, kBlockM>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const int grid = static_cast<int>(std::min<int64_t>(TileBound(p, kBlockN, kBlockM), dev.num_sms));
  v3::GemmWarpSpecializedKernel<kBlockN, kBlockM><<<grid, v3::kThreads, C::kSmemBytes, stream>>>(*map_a, *map_w, args);
  LS_CUDA_RETURN_IF_LAUNCH_ERROR(GemmWarpSpecializedKernel);
  return absl::OkStatus();
}

// Fraction of the last wave's SM slots that hold a tile.
double WaveEfficiency(int64_t tiles, int num_sms) {
  const int64_t waves = (tiles + num_sms - 1) / num_sms;
  return static_cast<double>(tiles) / static_cast<double>(waves * num_sms);
}

}  // namespace

int64_t TileBound(const DenseGemm& p, int block_n, int block_m) {
  const int64_t tiles_n = (p.n + block_n - 1) / block_n;
  if (p.group_offsets == nullptr) return (p.m + block_m - 1) / block_m * tiles_n;
  // Each group with rows has a partial row tile at most, besides its full ones.
  return (p.m / block_m + std::min<int64_t>(p.groups, p.m)) * tiles_n;
}

int AutoBlockMV3(const DenseGemm& p) {
  // Groups of a few dozen rows (a mixture of experts at ~128 tokens) fill
  // little of a 128-row tile; 64-row tiles waste half as much but move twice
  // the W per flop: faster at a few dozen rows per group, slower from 256.
  // Design record 0009.
  return p.group_offsets != nullptr && p.m < int64_t{128} * p.groups ? 64 : 128;
}

int AutoBlockNV3(int64_t m, int64_t n, int num_sms) {
  const int64_t tiles_m = (m + 127) / 128;
  const double e256 = WaveEfficiency(tiles_m * ((n + 255) / 256), num_sms);
  const double e128 = WaveEfficiency(tiles_m * ((n + 127) / 128), num_sms);
  // The wider tile moves a third less data per flop; it wins ties.
  return e128 > e256 + 0.05 ? 128 : 256;
}

absl::Status LaunchGemmV3(const DenseGemm& p, int block_n, int block_m, const DeviceInfo& dev, cudaStream_t stream) {
  if (block_m == 0) block_m = AutoBlockMV3(p);
  // A grouped product's row tiles are only known on the device; its bound
  // stands in for them.
  if (block_n == 0) block_n = AutoBlockNV3(TileBound(p, 256, 128) / ((p.n + 255) / 256) * 128, p.n, dev.num_sms);
  switch (block_n * 1000 + block_m) {
    case 128 * 1000 + 128:
      return Launch<128, 128>(p, dev, stream);
    case 256 * 1000 + 128:
      return Launch<256, 128>(p, dev, stream);
    case 128 * 1000 + 64:
      return Launch<128, 64>(p, dev, stream);
    case 256 * 1000 + 64:
      return Launch<256, 64>(p, dev, stream);
    default:
      return absl::InvalidArgumentError("gemm v3: block_n must be 0, 128 or 256 and block_m 0, 64 or 128");
  }
}

}  // namespace layerserve::kernels::gemm
