// Numbered versions of the flash-attention forward kernel (STYLE rule 3).
//
// Version 0 is the external baseline (PyTorch's flash and cuDNN backends, in
// bench/attention/torch_sdpa.py); versions 1..N are this library's tile
// configurations. The GPU tests validate every version, the benchmark times
// them side by side, and LaunchFlashAttention (the production entry point)
// calls DefaultFlashAttentionVersion's. Plain C++: no nvcc needed to include.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layerserve/kernels/attention.h"

namespace layerserve::kernels {

inline constexpr int kFlashAttentionVersions = 8;  // versions 1..8

// A one-line description ("v1 128x64 4 warps ...") of version 1..8.
const char* FlashAttentionVersionName(int version);

// Heads per dispatch section of the longest-first versions (4..8): the most
// whole GQA groups whose K and V (max_seqlen rows each) fit in three quarters
// of `l2_bytes` while their count divides num_kv_heads evenly (equal sections
// keep the last one as long as the others); at least one group.
int FlashHeadsPerSection(const FlashAttentionParams& p, int64_t l2_bytes);

// The version production uses for this problem on the current device, or
// an error if the device cannot be queried. The rule and the measurements
// behind it are in flash_attention.cu and docs/perf-attention.md.
absl::StatusOr<int> DefaultFlashAttentionVersion(const FlashAttentionParams& p);

// INVALID_ARGUMENT naming the first problem with `p`, else OK.
absl::Status ValidateFlashAttentionParams(const FlashAttentionParams& p);

// OK if version `version` runs valid params `p` on the current device and
// build; UNIMPLEMENTED saying why not (v8: head_dim 128, bf16, sm_90a build,
// compute capability 9.0), which is also what launching it would return.
absl::Status FlashAttentionVersionAvailable(const FlashAttentionParams& p, int version);

// Validates `p` and launches version `version` (1..kFlashAttentionVersions).
// `heads_per_section` (versions 4..8 only) must divide p.num_heads; 0 takes
// FlashHeadsPerSection for the current device. Tests and the benchmark set it
// to exercise and compare other section sizes.
absl::Status LaunchFlashAttentionVersion(const FlashAttentionParams& p, int version, cudaStream_t stream,
                                         int heads_per_section = 0);

namespace flash {
// One per flash_fwd_v*.cu; params already validated. Versions 1..3 ignore
// `heads_per_section`.
absl::Status RunFlashFwdV1(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream);
absl::Status RunFlashFwdV2(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream);
absl::Status RunFlashFwdV3(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream);
absl::Status RunFlashFwdV4(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream);
absl::Status RunFlashFwdV5(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream);
absl::Status RunFlashFwdV6(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream);
absl::Status RunFlashFwdV7(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream);
absl::Status RunFlashFwdV8(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream);
absl::Status FlashFwdV8Available(const FlashAttentionParams& p);
}  // namespace flash

}  // namespace layerserve::kernels
