// Host launcher of version 3 (gemm_v3_warp_specialized_sm90.cuh): tensor maps
// for A (block_m-row boxes: 128, or 64 for grouped products of small groups)
// and W (block_n-row boxes), one persistent CTA per SM
// (fewer when there are fewer tiles, or at most that many for a grouped
// product).
#include <algorithm>
#include <cstdint>

#include "kernels/gemm/gemm_heuristics.h"
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

}  // namespace

absl::Status LaunchGemmV3(const DenseGemm& p, int block_n, int block_m, const DeviceInfo& dev, cudaStream_t stream) {
  const V3Tiles tiles = ResolveV3Tiles(p, block_n, block_m, dev.num_sms);
  switch (tiles.block_n * 1000 + tiles.block_m) {
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
