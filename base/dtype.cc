// Element type names and conversions (see dtype.h).
#include "base/dtype.h"

#include <bit>
#include <cmath>

namespace layerserve {

std::string_view DTypeProtocolName(DType t) {
  switch (t) {
    case DType::kF32:
      return "FP32";
    case DType::kF16:
      return "FP16";
    case DType::kBF16:
      return "BF16";
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
  return std::nullopt;
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
  }
}

}  // namespace layerserve
