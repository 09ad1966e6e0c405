// The rates a benchmark's floor divides by, measured on the device in the
// same run rather than taken from another GPU: the copy bandwidth of a
// device-to-device cudaMemcpy of 1 GiB (bytes read plus bytes written, per
// second) and cuBLASLt's dense bf16 GEMM rate at 8192 x 8192 x 8192 (FLOP/s,
// random inputs). Each is the median of 10 timed runs after 3 warm-up ones,
// timed with CUDA events.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/statusor.h"
#include "layerserve/kernels/gemm.h"

namespace layerserve::bench {

struct DeviceRates {
  double copy_bytes_per_s = 0;
  double bf16_flops_per_s = 0;
};

// The copy bandwidth alone (bytes read plus written per second).
absl::StatusOr<double> MeasureCopyBytesPerSecond(cudaStream_t stream);

absl::StatusOr<DeviceRates> MeasureDeviceRates(kernels::GemmRouter& gemm, const kernels::GemmWorkspace& workspace,
                                               cudaStream_t stream);

}  // namespace layerserve::bench
