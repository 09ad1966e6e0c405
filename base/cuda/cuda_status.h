// CUDA runtime errors as absl::Status at the call site, and which of them
// leave the device context unusable. Used by the kernel launchers, the CUDA
// backend, the GEMM router and the GPU tools alike.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace layerserve {

// An INTERNAL status naming the failed call, its site and the CUDA error.
inline absl::Status CudaError(cudaError_t err, const char* what, const char* file, int line) {
  return absl::InternalError(absl::StrCat(file, ":", line, ": ", what, ": ", cudaGetErrorName(err),
                                          " (", cudaGetErrorString(err), ")"));
}

// True for errors after which the CUDA context is corrupt and every later call
// fails (illegal address, device-side assert, launch failure, ECC, ...): the
// process must restart, so a backend reports itself unhealthy for good.
bool IsStickyCudaError(cudaError_t err);

}  // namespace layerserve

// Returns an INTERNAL Status from the enclosing function if the CUDA runtime
// call fails.
#define LS_CUDA_RETURN_IF_ERROR(expr)                                          \
  do {                                                                         \
    const cudaError_t ls_cuda_err_ = (expr);                                   \
    if (ls_cuda_err_ != cudaSuccess) {                                         \
      return ::layerserve::CudaError(ls_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                                          \
  } while (0)

// After a kernel launch: reports launch-configuration errors (the launch itself
// is asynchronous; execution errors surface at the next synchronizing call).
#define LS_CUDA_RETURN_IF_LAUNCH_ERROR(kernel_name) LS_CUDA_RETURN_IF_ERROR(cudaPeekAtLastError())
