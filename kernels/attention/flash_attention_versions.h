// Numbered versions of the flash-attention forward kernel (STYLE rule 3).
//
// Version 0 is the external baseline (PyTorch's flash and cuDNN backends, in
// bench/attention/torch_sdpa.py). Of this library's versions, the ones serving
// can choose are built: 6 and 7 (sm80 mma.sync, every head_dim and dtype),
// 8 (sm90 wgmma, head_dim 128 bf16) and 9 (sequences of at most
// kFlashV9MaxSeqlen tokens, a warp per query row and head on CUDA cores). Versions 1-5 and the non-causal
// instantiations were removed after commit 92d9569 (design record 0007).
// The GPU tests validate every built version, the
// benchmark times them side by side, and LaunchFlashAttention (the production
// entry point) calls DefaultFlashAttentionVersion's. Plain C++: no nvcc needed
// to include.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layerserve/kernels/attention.h"

namespace layerserve::kernels {

// The versions built, in ascending order.
inline constexpr int kFlashAttentionVersions[] = {6, 7, 8, 9};

// The longest sequence v9 takes: its warps walk their keys one at a time.
inline constexpr int kFlashV9MaxSeqlen = 32;
// The longest the default gives it (flash_attention.cu: measured faster at
// 16 x 8 tokens, slower at 8 x 32).
inline constexpr int kFlashV9DefaultMaxSeqlen = 8;

// A one-line description ("v6 128x64 tile ...") of a built version.
const char* FlashAttentionVersionName(int version);

// Heads per dispatch section (every built version runs longest-first): the most
// whole GQA groups whose K and V (max_seqlen rows each) fit in three quarters
// of `l2_bytes` while their count divides num_kv_heads evenly (equal sections
// keep the last one as long as the others); at least one group.
int FlashHeadsPerSection(const FlashAttentionParams& p, int64_t l2_bytes);

// The version production uses for this problem on `dev` (a pure function:
// tests call it with a hand-made DeviceInfo). The rule, with worked examples,
// is in flash_attention.cu; design record 0006 says why.
int DefaultFlashAttentionVersion(const FlashAttentionParams& p, const DeviceInfo& dev);

// INVALID_ARGUMENT naming the first problem with `p`, else OK.
absl::Status ValidateFlashAttentionParams(const FlashAttentionParams& p);

// OK if version `version` runs valid params `p` on `dev` with this build;
// UNIMPLEMENTED saying why not (v8: head_dim 128, bf16, sm_90a build,
// compute capability 9.0; v9: max_seqlen at most kFlashV9MaxSeqlen), which
// is also what launching it would return;
// INVALID_ARGUMENT for a version that is not built.
absl::Status FlashAttentionVersionAvailable(const FlashAttentionParams& p, int version, const DeviceInfo& dev);

// Validates `p` and launches version `version` (one of kFlashAttentionVersions).
// `heads_per_section` must divide p.num_heads; 0 takes FlashHeadsPerSection
// for `dev`'s L2. Tests and the benchmark set it to exercise and compare other
// section sizes.
absl::Status LaunchFlashAttentionVersion(const FlashAttentionParams& p, int version, const DeviceInfo& dev,
                                         cudaStream_t stream, int heads_per_section = 0);

namespace flash {
// One per flash_fwd_v*.cu; params already validated.
absl::Status RunFlashFwdV6(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream);
absl::Status RunFlashFwdV7(const FlashAttentionParams& p, int heads_per_section, cudaStream_t stream);
absl::Status RunFlashFwdV8(const FlashAttentionParams& p, const DeviceInfo& dev, int heads_per_section,
                           cudaStream_t stream);
absl::Status FlashFwdV8Available(const FlashAttentionParams& p, const DeviceInfo& dev);
absl::Status RunFlashFwdV9(const FlashAttentionParams& p, cudaStream_t stream);
absl::Status FlashFwdV9Available(const FlashAttentionParams& p);
}  // namespace flash

}  // namespace layerserve::kernels
