// QueryDeviceInfo / CurrentDeviceInfo (layerserve/kernels/common.h): the
// device attributes dispatch reads, in one place.
#include <cuda_runtime_api.h>

#include "layerserve/kernels/common.h"

namespace layerserve::kernels {

absl::StatusOr<DeviceInfo> QueryDeviceInfo(int ordinal) {
  DeviceInfo info;
  info.ordinal = ordinal;
  LS_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, ordinal));
  LS_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, ordinal));
  LS_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, ordinal));
  LS_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&info.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal));
  LS_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&info.l2_bytes, cudaDevAttrL2CacheSize, ordinal));
  return info;
}

absl::StatusOr<DeviceInfo> CurrentDeviceInfo() {
  int device = 0;
  LS_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  return QueryDeviceInfo(device);
}

}  // namespace layerserve::kernels
