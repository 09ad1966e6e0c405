// Error checking for the CUDA backend: cuBLASLt statuses as absl::Status with
// the call site (the CUDA runtime's equivalent, LS_CUDA_RETURN_IF_ERROR, comes
// from the kernel library's common.h), and the classification of CUDA errors
// that leave the device context unusable.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "layerserve/kernels/common.h"

namespace layerserve::cuda {

// An INTERNAL status naming the failed cuBLASLt call and its site.
absl::Status CublasError(cublasStatus_t status, const char* what, const char* file, int line);

// True for errors after which the CUDA context is corrupt and every later call
// fails (illegal address, device-side assert, launch failure, ECC, ...): the
// process must restart, so the backend reports itself unhealthy for good.
bool IsStickyCudaError(cudaError_t err);

}  // namespace layerserve::cuda

// Returns an INTERNAL Status from the enclosing function if the cuBLASLt call
// fails.
#define LS_CUBLAS_RETURN_IF_ERROR(expr)                                                     \
  do {                                                                                      \
    const cublasStatus_t ls_cublas_status_ = (expr);                                        \
    if (ls_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                         \
      return ::layerserve::cuda::CublasError(ls_cublas_status_, #expr, __FILE__, __LINE__); \
  } while (0)
