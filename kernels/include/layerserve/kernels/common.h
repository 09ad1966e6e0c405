// Shared vocabulary of the kernel library: element types and the device facts
// every dispatch decision reads (DeviceInfo). CUDA errors become absl::Status
// through base/cuda/cuda_status.h, included here for every launcher.
//
// Plain C++ (compiles without nvcc): server code includes these headers; only
// the .cu launchers behind them need the CUDA compiler.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/cuda/cuda_status.h"

namespace layerserve::kernels {

// Activation and weight element types on the device.
enum class DType { kBF16, kF16, kF32 };

inline int DTypeBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

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
