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
    case 6:
      return "v6 128x64 tile, 4 warps x 32 rows, Q in smem, longest first, lazy rescale";
    case 7:
      return "v7 64x64 tile, 4 warps x 16 rows, Q in registers, longest first, lazy rescale";
    case 8:
      return "v8 128x128 wgmma, 2 warpgroups, sm_90a";
    case 9:
      return "v9 short sequences, a warp per query row and head";
    default:
      return "unknown";
  }
}

// v8 (wgmma, Hopper only: head_dim 128, bf16, sm_90a build, CC 9.0) beat v6
// and v7 on every measured shape, by 1.25x-1.45x over v6, so it is taken
// wherever it runs. H100, 32 heads / 8 KV heads, head_dim 128, causal bf16, TFLOP/s
// from one call, v8 (two bench runs) / v6 / v7:
//   1 x 2048:  375.4, 373.1 / 266.8 / 255.2   4 x 512:  194.8, 195.9 / 149.0 / 168.4
//   1 x 4096:  454.4, 461.6 / 321.5 / 287.6   4 x 1024: 307.4, 313.3 / 245.3 / 228.6
//   1 x 8192:  500.4, 500.8 / 344.1 / 300.7   8 x 1024: 322.4, 322.4 / 257.1 / 235.0
//   1 x 16384: 498.7, 493.9 / 359.0 / 304.8   mixed 8k: 417.1, 419.9 / 309.9 / 273.4
// Elsewhere (head_dim 64, fp16, other GPUs) v6 is fastest on
// every measured shape but one: many short sequences in a short grid, where
// v7's 64-row tiles (same schedule and rescale) give twice the CTAs to
// balance and each CTA's fixed cost (Q load, output store) is a large share
// of its few key tiles. Measured on the H100 (132 SMs; 32 heads / 8 KV heads, head_dim 128,
// causal bf16, TFLOP/s v6 / v7, two bench runs; v1 tiles = query tiles of 128
// rows x heads x sequences, 792 = 3 waves at 2 CTAs per SM):
//   1 x 2048:  512 v1 tiles -> v6 (272, 270 / 260, 258)
//   4 x 512:   512 v1 tiles -> v7 (150, 149 / 171, 170)
//   4 x 1024: 1024 v1 tiles -> v6 (249, 249 / 232, 231)
//   1 x 4096: 1024 v1 tiles -> v6 (320, 317 / 290, 288)
//   1 x 8192: 2048 v1 tiles -> v6 (343, 341 / 300, 302)
// So v7 needs both a grid under 3 waves and max_seqlen at most 1024 (between
// the measured 512 and 2048). The count is an upper bound: lengths are on the
// device, so every sequence is counted at max_seqlen. A sliding window does
// not enter the rule, as no windowed shape has been measured yet: a window
// shortens every tile past it to about window + 128 keys, so each CTA's fixed
// cost weighs more, which is where v7 won; flash_attention_bench --window
// measures it. (A grid too large for
// the longest-first enumeration, query tiles x heads > 2^31 - 1, is refused
// at launch; serving's --max-batch-tokens keeps far below it.)
//
// v9 comes first up to kFlashV9DefaultMaxSeqlen tokens: a tiled version
// spends a whole query tile per sequence and head however few rows the
// sequence has. H100, 32 / 8 heads, head_dim 128, bf16, one fused qkv
// buffer, us per call v6 / v7 / v8 / v9:
//   1 x 1:    9 /   8 /   8 / 7     97 x 1:  80 /  48 / 108 / 8
//   28 x 1:  29 /  18 /  35 / 8    256 x 1: 199 / 120 / 271 / 8
//   16 x 8:  18 /  12 /  22 / 9      8 x 32: 12 /   9 /  14 / 25
// Design record 0006.
int DefaultFlashAttentionVersion(const FlashAttentionParams& p, const DeviceInfo& dev) {
  constexpr int kV1BlockM = 128, kV1CtasPerSm = 2, kMinWaves = 3, kShortSeqlen = 1024;
  const int64_t v1_tiles_per_seq = int64_t{(p.max_seqlen + kV1BlockM - 1) / kV1BlockM} * p.num_heads;
  if (p.max_seqlen <= kFlashV9DefaultMaxSeqlen) return 9;
  if (flash::FlashFwdV8Available(p, dev).ok()) return 8;
  const bool short_grid = int64_t{p.num_seqs} * v1_tiles_per_seq < int64_t{kMinWaves} * kV1CtasPerSm * dev.num_sms;
  return short_grid && p.max_seqlen <= kShortSeqlen ? 7 : 6;
}

int FlashHeadsPerSection(const FlashAttentionParams& p, int64_t l2_bytes) {
  // Within a section every head's tiles run side by side, so the K/V of all
  // its heads are read concurrently and should stay in L2. Measured on the
  // H100 (50 MB L2): one section of all 32 heads at 8192 tokens (K/V 32 MiB,
  // 64% of L2) ran 0-2.5% faster than sections of 8 heads, so L2 is not yet
  // thrashing there; three quarters leaves room for the streamed Q and O.
  // Longer sequences (sections below all heads) are not yet measured.
  // A sliding window is left out on purpose: the tiles running at once then
  // read only a band of keys (their window, plus the query tiles in flight)
  // rather than the head's whole K/V, so sizing by max_seqlen errs towards
  // smaller sections, which costs nothing in correctness and, as sections
  // follow one another without a barrier, little in balance.
  const int64_t kv_bytes_per_head = int64_t{p.max_seqlen} * p.head_dim * 2 /*K and V*/ * 2 /*16-bit*/;
  const int64_t budget = l2_bytes / 4 * 3;
  int kv_heads = 1;
  for (int d = 2; d <= p.num_kv_heads; ++d) {
    if (p.num_kv_heads % d == 0 && d * kv_bytes_per_head <= budget) kv_heads = d;
  }
  return kv_heads * (p.num_heads / p.num_kv_heads);
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
  if (p.window < 0) {
    return absl::InvalidArgumentError(absl::StrCat("flash attention: window must be >= 0 (0: none), got ", p.window));
  }
  if (p.num_heads <= 0 || p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("flash attention: num_heads (", p.num_heads,
                                                   ") must be a positive multiple of num_kv_heads (", p.num_kv_heads,
                                                   ")"));
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

absl::Status FlashAttentionVersionAvailable(const FlashAttentionParams& p, int version, const DeviceInfo& dev) {
  switch (version) {
    case 6:
    case 7:
      return absl::OkStatus();
    case 8:
      return flash::FlashFwdV8Available(p, dev);
    case 9:
      return flash::FlashFwdV9Available(p);
    default:
      return absl::InvalidArgumentError(absl::StrCat("flash attention: no version ", version, " is built"));
  }
}

absl::Status LaunchFlashAttentionVersion(const FlashAttentionParams& p, int version, const DeviceInfo& dev,
                                         cudaStream_t stream, int heads_per_section) {
  if (absl::Status s = ValidateFlashAttentionParams(p); !s.ok()) return s;
  if (p.num_seqs == 0 || p.max_seqlen == 0) return absl::OkStatus();
  if (heads_per_section < 0 || (heads_per_section > 0 && p.num_heads % heads_per_section != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash attention: heads_per_section ", heads_per_section, " does not divide num_heads"));
  }
  if (heads_per_section == 0) heads_per_section = FlashHeadsPerSection(p, dev.l2_bytes);
  switch (version) {
    case 6:
      return flash::RunFlashFwdV6(p, heads_per_section, stream);
    case 7:
      return flash::RunFlashFwdV7(p, heads_per_section, stream);
    case 8:
      return flash::RunFlashFwdV8(p, dev, heads_per_section, stream);
    case 9:  // no sections: each warp reads only its own row's keys
      return flash::RunFlashFwdV9(p, stream);
    default:
      return absl::InvalidArgumentError(absl::StrCat("flash attention: no version ", version, " is built"));
  }
}

absl::Status LaunchFlashAttention(const FlashAttentionParams& p, const DeviceInfo& dev, cudaStream_t stream) {
  if (absl::Status s = ValidateFlashAttentionParams(p); !s.ok()) return s;
  if (p.num_seqs == 0 || p.max_seqlen == 0) return absl::OkStatus();
  return LaunchFlashAttentionVersion(p, DefaultFlashAttentionVersion(p, dev), dev, stream);
}

}  // namespace layerserve::kernels
