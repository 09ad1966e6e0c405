// Shared vocabulary of the kernel library: element types, CUDA error
// checking that turns failures into absl::Status at the call site, and the
// device facts every dispatch decision reads (DeviceInfo).
//
// Plain C++ (compiles without nvcc): server code includes these headers; only
// the .cu launchers behind them need the CUDA compiler.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace layerserve::kernels {

// Activation and weight element types on the device.
enum class DType { kBF16, kF16, kF32 };

inline int DTypeBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// A CUDA runtime error as a Status naming the call site.
inline absl::Status CudaError(cudaError_t err, const char* what, const char* file, int line) {
  return absl::InternalError(absl::StrCat(file, ":", line, ": ", what, ": ", cudaGetErrorName(err), " (",
                                          cudaGetErrorString(err), ")"));
}

// What dispatch heuristics need to know about a device, captured once (by
// whoever creates the object that launches: the GEMM router, the layer
// executor) instead of queried on every launch. Heuristics are pure functions
// of a problem's shape and a DeviceInfo, so tests build one by hand (an H100:
// 132 SMs, CC 9.0, 227 KiB opt-in shared memory, 50 MiB L2) and run without
// a GPU.
struct DeviceInfo {
  int ordinal = 0;
  int num_sms = 0;
  int cc_major = 0;
  int cc_minor = 0;
  int max_smem_optin = 0;  // bytes of dynamic shared memory a block may opt into
  int l2_bytes = 0;

  bool IsHopper() const { return cc_major == 9 && cc_minor == 0; }
};

// The facts of CUDA device `ordinal`.
absl::StatusOr<DeviceInfo> QueryDeviceInfo(int ordinal);
// The facts of the calling thread's current device.
absl::StatusOr<DeviceInfo> CurrentDeviceInfo();

}  // namespace layerserve::kernels

// Returns an INTERNAL Status from the enclosing function if the CUDA runtime
// call fails.
#define LS_CUDA_RETURN_IF_ERROR(expr)                                                       \
  do {                                                                                      \
    const cudaError_t ls_cuda_err_ = (expr);                                                \
    if (ls_cuda_err_ != cudaSuccess)                                                        \
      return ::layerserve::kernels::CudaError(ls_cuda_err_, #expr, __FILE__, __LINE__);     \
  } while (0)

// After a kernel launch: reports launch-configuration errors (the launch itself
// is asynchronous; execution errors surface at the next synchronizing call).
#define LS_CUDA_RETURN_IF_LAUNCH_ERROR(kernel_name) \
  LS_CUDA_RETURN_IF_ERROR(cudaPeekAtLastError())
