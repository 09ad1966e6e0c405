// Elementwise and normalization kernels of a Llama decoder layer, launched on
// a caller's stream over packed activations [tokens, width] (row-major).
//
// Each launcher validates its params, launches, checks the launch, and
// returns; nothing synchronizes. Activations are bf16 or fp16; statistics and
// rotations are computed in fp32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "layerserve/kernels/common.h"

namespace layerserve::kernels {

// y = RMSNorm(h) * weight, with h = x (+ residual when given).
// When `residual` is non-null, h is also written to `h_out` (which may alias
// `x` or `residual`), fusing the residual add of the previous sub-layer.
struct RmsNormParams {
  const void* x = nullptr;         // [rows, cols]
  const void* residual = nullptr;  // [rows, cols] or null
  void* h_out = nullptr;           // [rows, cols]; required iff residual != null
  const void* weight = nullptr;    // [cols]
  void* y = nullptr;               // [rows, cols]
  int64_t rows = 0;
  int64_t cols = 0;
  float eps = 1e-6f;
  DType dtype = DType::kBF16;  // of x, residual, h_out, weight, y
  // y quantized for an FP8 linear as well (bf16 only), exactly as
  // LaunchQuantizeFp8 of y would (QuantizeFp8Params' fields and layout), in
  // the same pass: fp8_group 0 (per row; fp8_static_scale > 0: that scale)
  // or 128 (cols a multiple of 128). Null fp8_codes: no FP8 output.
  void* fp8_codes = nullptr;
  float* fp8_scales = nullptr;
  int64_t fp8_group = 0;
  float fp8_static_scale = 0.f;
};
absl::Status LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream);

// Rotary embedding (rotate-half convention), in place on the q and k parts of
// a fused qkv activation [tokens, (heads + 2*kv_heads) * head_dim] laid out
// q | k | v along each row. Token t has position positions[t].
// With q_norm and k_norm (Qwen3), every q and k head is first RMS-normalised
// over its head_dim and scaled by that weight, rounded as RmsNorm rounds.
struct RopeParams {
  void* qkv = nullptr;
  const int32_t* positions = nullptr;  // [tokens], device
  const float* inv_freq = nullptr;     // [head_dim / 2], device
  int64_t tokens = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  const void* q_norm = nullptr;  // [head_dim], or null (and then k_norm null too)
  const void* k_norm = nullptr;  // [head_dim]
  float norm_eps = 1e-6f;
  DType dtype = DType::kBF16;
};
absl::Status LaunchRope(const RopeParams& p, cudaStream_t stream);

// The MLP's gate and up projections share one weight matrix on the device,
// their rows interleaved in blocks of kGateUpBlock: rows [16 b, 16 b + 8) are
// gate features [8 b, 8 b + 8), rows [16 b + 8, 16 b + 16) the same up
// features. A GEMM tile or a thread that holds a column of gate outputs then
// holds the matching up outputs too, so the activation can run in the GEMM's
// epilogue (GemmParams::silu_mul) and the gate/up product never reaches
// memory. Widths are multiples of kGateUpBlock.
inline constexpr int64_t kGateUpBlock = 8;
// The interleaved row of gate (up = false) or up (up = true) feature i.
constexpr int64_t GateUpRow(int64_t i, bool up) {
  return (i / kGateUpBlock) * 2 * kGateUpBlock + (up ? kGateUpBlock : 0) + i % kGateUpBlock;
}

// out = silu(gate) * up, where each row of gate_up holds gate and up outputs
// interleaved as GateUpRow says (column GateUpRow(i, false) is gate i), in
// blocks of `block` (kGateUpBlock; an FP8 gate/up's kFp8GateUpBlock).
struct SiluMulParams {
  const void* gate_up = nullptr;  // [rows, 2 * width], interleaved
  void* out = nullptr;            // [rows, width]
  int64_t rows = 0;
  int64_t width = 0;             // a multiple of block
  int64_t block = kGateUpBlock;  // a multiple of kGateUpBlock
  DType dtype = DType::kBF16;
};
absl::Status LaunchSiluMul(const SiluMulParams& p, cudaStream_t stream);

// Quantizes activations to float8_e4m3fn before an FP8 product (gemm.h's
// Fp8Scaling), as the checkpoint formats define it: codes[r, c] = e4m3(x[r,
// c] / s), rounded to nearest even and saturating at +-448 (bit for bit what
// ml_dtypes and base/dtype.h's FloatToFp8E4M3 give), where s is static_scale
// when that is > 0, else amax / 448 over the row (group 0) or over each
// `group`-column slice of it. An all-zero slice gets scale 0 and zero codes.
// Scales: [rows] for group 0; [ceil(cols / group)][rows], token-contiguous,
// for groups (the layout of Fp8Scaling::kBlock's a_scale).
struct QuantizeFp8Params {
  const void* x = nullptr;  // [rows, cols], bf16
  void* codes = nullptr;    // [rows, cols], e4m3
  float* scales = nullptr;  // see above
  int64_t rows = 0;
  int64_t cols = 0;          // a multiple of 16
  int64_t group = 0;         // 0 (per row) or 128
  float static_scale = 0.f;  // > 0: this scale for every row (group 0 only)
};
absl::Status LaunchQuantizeFp8(const QuantizeFp8Params& p, cudaStream_t stream);

// Element type conversion, n elements (for wire <-> activation dtypes).
struct CastParams {
  const void* src = nullptr;
  DType src_dtype = DType::kF32;
  void* dst = nullptr;
  DType dst_dtype = DType::kBF16;
  int64_t n = 0;
};
absl::Status LaunchCast(const CastParams& p, cudaStream_t stream);

}  // namespace layerserve::kernels
