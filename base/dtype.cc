// Element type names and conversions (see dtype.h).
#include "base/dtype.h"

#include <bit>
#include <cmath>
#include <limits>

namespace layerserve {

std::string_view DTypeProtocolName(DType t) {
  switch (t) {
    case DType::kF32:
      return "FP32";
    case DType::kF16:
      return "FP16";
    case DType::kBF16:
      return "BF16";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  return "?";
}

std::optional<DType> ParseProtocolDType(std::string_view name) {
  if (name == "FP32") return DType::kF32;
  if (name == "FP16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  return std::nullopt;
}

std::optional<DType> ParseSafetensorsDType(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  return std::nullopt;
}

float Fp8E4M3ToFloat(uint8_t bits) {
  const uint32_t exp = (bits >> 3) & 0xfu;
  const uint32_t mant = bits & 0x7u;
  float magnitude;
  if (exp == 0xfu && mant == 0x7u) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    magnitude = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant x 2^-9
  } else {
    magnitude = std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, static_cast<int>(exp) - 7);
  }
  return (bits & 0x80u) != 0 ? -magnitude : magnitude;
}

uint8_t FloatToFp8E4M3(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7fu;  // NaN
  const float a = std::bit_cast<float>(abs);
  // 464 is the midpoint between 448 and the next step, 480, which e4m3fn
  // spends on NaN: below it a value rounds to at most 448 (464 itself ties
  // to 448, the even mantissa), from it on it saturates.
  if (a >= 464.0f) return sign | 0x7eu;
  if (a < 0.015625f) {
    // Subnormal (or zero) in e4m3: an integer count of 2^-9 units, rounded
    // to nearest even by the FPU (the scaling is exact). 8 units is 2^-6,
    // the smallest normal, whose code is 0x08 too.
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  }
  // Normal: rebias the exponent (127 -> 7) and round the 23 mantissa bits
  // to 3, ties to even; a carry into the exponent is the right result.
  uint32_t v = abs - (120u << 23);
  v += 0x7ffffu + ((v >> 20) & 1u);
  return sign | static_cast<uint8_t>(v >> 20);
}

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: value = mant * 2^-24.
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

uint16_t FloatToFp16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero) in fp16: scale into an integer count of
    // 2^-24 units and let the FPU round to nearest even.
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;  // 2^24
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  // Normal: rebias exponent, round mantissa to 10 bits (nearest even).
  uint32_t v = abs - (112u << 23);
  v += 0xfffu + ((v >> 13) & 1u);
  return sign | static_cast<uint16_t>(v >> 13);
}

void ConvertToFloat(DType src_type, const void* src, size_t count, float* dst) {
  const auto* bytes = static_cast<const unsigned char*>(src);
  switch (src_type) {
    case DType::kF32:
      std::memcpy(dst, src, count * 4);
      return;
    case DType::kBF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t b;
        std::memcpy(&b, bytes + 2 * i, 2);
        dst[i] = Bf16ToFloat(b);
      }
      return;
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t b;
        std::memcpy(&b, bytes + 2 * i, 2);
        dst[i] = Fp16ToFloat(b);
      }
      return;
    case DType::kF8E4M3:
      for (size_t i = 0; i < count; ++i) dst[i] = Fp8E4M3ToFloat(bytes[i]);
      return;
  }
}

void ConvertFromFloat(const float* src, size_t count, DType dst_type, void* dst) {
  auto* bytes = static_cast<unsigned char*>(dst);
  switch (dst_type) {
    case DType::kF32:
      std::memcpy(dst, src, count * 4);
      return;
    case DType::kBF16:
      for (size_t i = 0; i < count; ++i) {
        const uint16_t b = FloatToBf16(src[i]);
        std::memcpy(bytes + 2 * i, &b, 2);
      }
      return;
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        const uint16_t b = FloatToFp16(src[i]);
        std::memcpy(bytes + 2 * i, &b, 2);
      }
      return;
    case DType::kF8E4M3:
      for (size_t i = 0; i < count; ++i) bytes[i] = FloatToFp8E4M3(src[i]);
      return;
  }
}

}  // namespace layerserve
