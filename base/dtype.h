// Element types that cross the wire and the conversions between them.
//
// Activations arrive as BF16, FP16 or FP32 (Open Inference Protocol datatype
// strings); weights come from safetensors as BF16, F16, F32 or, in FP8
// checkpoints, F8_E4M3 (float8_e4m3fn, never on the wire). The CPU backend
// computes in float32; these helpers convert element-wise with round-to-nearest-
// even, matching torch's casts (and ml_dtypes' for float8_e4m3fn).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>

namespace layerserve {

enum class DType { kF32, kF16, kBF16, kF8E4M3 };

// Bytes per element.
constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : t == DType::kF8E4M3 ? 1 : 2; }

// Open Inference Protocol datatype string: "FP32", "FP16", "BF16"; kF8E4M3,
// which the protocol does not carry, is "F8_E4M3" (for messages).
std::string_view DTypeProtocolName(DType t);
// Parses a protocol datatype string; nullopt for anything else (including
// valid protocol types this server does not accept, such as "INT32").
std::optional<DType> ParseProtocolDType(std::string_view name);
// safetensors dtype string: "F32", "F16", "BF16", "F8_E4M3".
std::optional<DType> ParseSafetensorsDType(std::string_view name);

inline float Bf16ToFloat(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round-to-nearest-even; NaN stays NaN (quiet).
inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float Fp16ToFloat(uint16_t bits);
uint16_t FloatToFp16(float f);

// float8_e4m3fn: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; largest
// finite 448, smallest subnormal 2^-9, no infinities, 0x7f and 0xff NaN.
inline constexpr float kFp8E4M3Max = 448.0f;
float Fp8E4M3ToFloat(uint8_t bits);
// Round to nearest, ties to even, saturating: every finite value and the
// infinities beyond 448 become +-448 (as the GPU's cvt.rn.satfinite does,
// and as the checkpoint formats' quantizers clamp before they cast); NaN
// stays NaN (0x7f with the sign). Bit-exact with ml_dtypes.float8_e4m3fn
// for |f| <= 464, above which ml_dtypes gives NaN instead
// (tests/unit/base/fp8_e4m3_golden.txt).
uint8_t FloatToFp8E4M3(float f);

// Converts `count` elements of `src` (type `src_type`, raw bytes, any
// alignment) to float32.
void ConvertToFloat(DType src_type, const void* src, size_t count, float* dst);
// Converts `count` floats to `dst_type`, writing raw bytes to `dst`.
void ConvertFromFloat(const float* src, size_t count, DType dst_type, void* dst);

}  // namespace layerserve
