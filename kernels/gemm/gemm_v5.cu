// Host launcher of version 5 (gemm_v5_cluster_multicast_sm90.cuh): tensor
// maps for A (128-row boxes), W (128-row boxes, half a 256-row tile each) and
// C (64x64 boxes, the epilogue's chunks), and a persistent grid of 2-CTA
// clusters, as many as the device keeps resident at once (so that no cluster
// waits for a second wave).
#include <algorithm>
#include <cstdint>
#include <map>

#include "kernels/gemm/gemm_internal.h"
#include "kernels/gemm/gemm_v5_cluster_multicast_sm90.cuh"

namespace layerserve::kernels::gemm {
namespace {

// Clusters of the v5 kernel that fit on the current device at once. Fixed per
// device (the kernel's resources are constant), so asked once per device and
// thread, keeping the query off the launch path.
absl::StatusOr<int> MaxResidentClusters(const cudaLaunchConfig_t& config) {
  int device = 0;
  LS_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  thread_local std::map<int, int> remembered;
  if (const auto it = remembered.find(device); it != remembered.end()) return it->second;
  int clusters = 0;
  LS_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveClusters(&clusters, v5::GemmClusterMulticastKernel, &config));
  if (clusters < 1) return absl::ResourceExhaustedError("gemm v5: no 2-CTA cluster fits on this device");
  remembered.emplace(device, clusters);
  return clusters;
}

}  // namespace

absl::Status LaunchGemmV5(const DenseGemm& p, const DeviceInfo& dev, cudaStream_t stream) {
  if (dev.max_smem_optin < v5::kSmemBytes) return absl::ResourceExhaustedError("gemm v5: not enough shared memory");
  // tiles_m counts 256-row cluster tiles.
  const GemmArgs args = MakeGemmArgs(p, v5::kClusterBlockM, v5::kBlockN);
  absl::StatusOr<CUtensorMap> map_a = MakeBf16TensorMap(p.a, p.m, p.k, v5::kBlockM);
  if (!map_a.ok()) return map_a.status();
  absl::StatusOr<CUtensorMap> map_w = MakeBf16TensorMap(p.w, p.n, p.k, v5::kWSliceRows);
  if (!map_w.ok()) return map_w.status();
  absl::StatusOr<CUtensorMap> map_c = MakeBf16TensorMap(p.c, p.m, p.n, v5::kChunkRows);
  if (!map_c.ok()) return map_c.status();
  LS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(v5::GemmClusterMulticastKernel,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, v5::kSmemBytes));
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = v5::kClusterM;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(v5::kThreads);
  config.dynamicSmemBytes = v5::kSmemBytes;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  config.gridDim = dim3(static_cast<unsigned>(dev.num_sms / v5::kClusterM * v5::kClusterM));
  const absl::StatusOr<int> resident = MaxResidentClusters(config);
  if (!resident.ok()) return resident.status();
  const int clusters = std::min(args.tiles_m * args.tiles_n, *resident);
  config.gridDim = dim3(static_cast<unsigned>(clusters * v5::kClusterM));
  LS_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, v5::GemmClusterMulticastKernel, *map_a, *map_w, *map_c, args));
  return absl::OkStatus();
}

}  // namespace layerserve::kernels::gemm
