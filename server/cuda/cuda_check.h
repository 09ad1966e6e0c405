// The classification of CUDA errors that leave the device context unusable.
// (CUDA runtime calls become absl::Status through LS_CUDA_RETURN_IF_ERROR, from
// the kernel library's common.h; cuBLASLt is called only by the GEMM router.)
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "layerserve/kernels/common.h"

namespace layerserve::cuda {

// True for errors after which the CUDA context is corrupt and every later call
// fails (illegal address, device-side assert, launch failure, ECC, ...): the
// process must restart, so the backend reports itself unhealthy for good.
bool IsStickyCudaError(cudaError_t err);

}  // namespace layerserve::cuda
