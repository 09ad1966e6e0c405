// Entry points of the flash-attention forward: parameter validation, the
// numbered-version dispatch shared by tests and benchmark, and the production
// launcher that picks the default version.
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/attention/flash_attention_versions.h"
#include "layerserve/kernels/attention.h"

namespace layerserve::kernels {
namespace {

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

const char* FlashAttentionVersionName(int version) {
  switch (version) {
    case 1:
      return "v1 128x64 tile, 4 warps x 32 rows, Q in smem";
    case 2:
      return "v2 128x64 tile, 8 warps x 16 rows, Q in smem";
    case 3:
      return "v3 64x64 tile, 4 warps x 16 rows, Q in registers";
    default:
      return "unknown";
  }
}

// v1's 128-row tiles do the most work per byte of shared memory read, but a
// grid of few of them leaves SMs idle in its last wave (causal tiles also
// differ in length). With fewer than 3 waves of v1 tiles (2 CTAs per SM fit),
// v3's 64-row tiles give twice the CTAs to balance. Measured on the H100
// (132 SMs, so 792 tiles; 32 heads, head_dim 128, causal bf16, TFLOP/s v1 / v3):
//   1 x 2048 tokens:  512 tiles -> v3 (191 / 208)
//   4 x 512:          512 tiles -> v3 (137 / 151)
//   1 x 4096:        1024 tiles -> v1 (255 / 248)
//   1 x 8192:        2048 tiles -> v1 (298 / 273)
// The tile count is an upper bound: lengths are on the device, so every
// sequence is counted at max_seqlen.
absl::StatusOr<int> DefaultFlashAttentionVersion(const FlashAttentionParams& p) {
  int device = 0, sm_count = 0;
  LS_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  LS_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  constexpr int kV1BlockM = 128, kV1CtasPerSm = 2, kMinWaves = 3;
  const int64_t v1_tiles = int64_t{p.num_seqs} * ((p.max_seqlen + kV1BlockM - 1) / kV1BlockM) * p.num_heads;
  return v1_tiles < int64_t{kMinWaves} * kV1CtasPerSm * sm_count ? 3 : 1;
}

absl::Status ValidateFlashAttentionParams(const FlashAttentionParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat("flash attention: head_dim must be 64 or 128, got ", p.head_dim));
  }
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16) {
    return absl::InvalidArgumentError("flash attention: dtype must be bf16 or fp16");
  }
  if (p.num_seqs < 0 || p.max_seqlen < 0) {
    return absl::InvalidArgumentError("flash attention: num_seqs and max_seqlen must be >= 0");
  }
  if (p.num_heads <= 0 || p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("flash attention: num_heads (", p.num_heads,
                                                   ") must be a positive multiple of num_kv_heads (",
                                                   p.num_kv_heads, ")"));
  }
  if (p.num_seqs > 65535 || p.num_heads > 65535) {
    return absl::InvalidArgumentError("flash attention: num_seqs and num_heads must be <= 65535 (grid limits)");
  }
  if (!(p.softmax_scale > 0.f)) {
    return absl::InvalidArgumentError("flash attention: softmax_scale must be positive");
  }
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.out == nullptr || p.cu_seqlens == nullptr) {
    return absl::InvalidArgumentError("flash attention: q, k, v, out and cu_seqlens must be set");
  }
  // Tiles move in 16-byte chunks: every row must start 16-byte aligned.
  if (!Aligned16(p.q) || !Aligned16(p.k) || !Aligned16(p.v) || !Aligned16(p.out) || p.q_row_stride % 8 != 0 ||
      p.k_row_stride % 8 != 0 || p.v_row_stride % 8 != 0 || p.out_row_stride % 8 != 0) {
    return absl::InvalidArgumentError(
        "flash attention: q, k, v, out must be 16-byte aligned with row strides a multiple of 8 elements");
  }
  if (p.q_row_stride < int64_t{p.num_heads} * p.head_dim || p.out_row_stride < int64_t{p.num_heads} * p.head_dim ||
      p.k_row_stride < int64_t{p.num_kv_heads} * p.head_dim || p.v_row_stride < int64_t{p.num_kv_heads} * p.head_dim) {
    return absl::InvalidArgumentError("flash attention: a row stride is shorter than its row");
  }
  return absl::OkStatus();
}

absl::Status LaunchFlashAttentionVersion(const FlashAttentionParams& p, int version, cudaStream_t stream) {
  if (absl::Status s = ValidateFlashAttentionParams(p); !s.ok()) return s;
  if (p.num_seqs == 0 || p.max_seqlen == 0) return absl::OkStatus();
  switch (version) {
    case 1:
      return flash::RunFlashFwdV1(p, stream);
    case 2:
      return flash::RunFlashFwdV2(p, stream);
    case 3:
      return flash::RunFlashFwdV3(p, stream);
    default:
      return absl::InvalidArgumentError(absl::StrCat("flash attention: no version ", version));
  }
}

absl::Status LaunchFlashAttention(const FlashAttentionParams& p, cudaStream_t stream) {
  if (absl::Status s = ValidateFlashAttentionParams(p); !s.ok()) return s;
  if (p.num_seqs == 0 || p.max_seqlen == 0) return absl::OkStatus();
  absl::StatusOr<int> version = DefaultFlashAttentionVersion(p);
  if (!version.ok()) return version.status();
  return LaunchFlashAttentionVersion(p, *version, stream);
}

}  // namespace layerserve::kernels
