// Numbered versions of the flash-attention forward kernel (STYLE rule 3).
//
// Version 0 is the external baseline (PyTorch's flash and cuDNN backends, in
// bench/attention/torch_sdpa.py); versions 1..N are this library's tile
// configurations. The GPU tests validate every version, the benchmark times
// them side by side, and LaunchFlashAttention (the production entry point)
// calls DefaultFlashAttentionVersion's. Plain C++: no nvcc needed to include.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layerserve/kernels/attention.h"

namespace layerserve::kernels {

inline constexpr int kFlashAttentionVersions = 3;  // versions 1..3

// A one-line description ("v1 128x64 4 warps ...") of version 1..3.
const char* FlashAttentionVersionName(int version);

// The version production uses for this problem on the current device, or
// an error if the device cannot be queried. The rule and the measurements
// behind it are in flash_attention.cu and docs/perf-attention.md.
absl::StatusOr<int> DefaultFlashAttentionVersion(const FlashAttentionParams& p);

// INVALID_ARGUMENT naming the first problem with `p`, else OK.
absl::Status ValidateFlashAttentionParams(const FlashAttentionParams& p);

// Validates `p` and launches version `version` (1..kFlashAttentionVersions).
absl::Status LaunchFlashAttentionVersion(const FlashAttentionParams& p, int version, cudaStream_t stream);

namespace flash {
// One per flash_fwd_v*.cu; params already validated.
absl::Status RunFlashFwdV1(const FlashAttentionParams& p, cudaStream_t stream);
absl::Status RunFlashFwdV2(const FlashAttentionParams& p, cudaStream_t stream);
absl::Status RunFlashFwdV3(const FlashAttentionParams& p, cudaStream_t stream);
}  // namespace flash

}  // namespace layerserve::kernels
