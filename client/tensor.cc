// Tensor helpers for the client (see tensor.h).
#include "client/tensor.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace layerserve::client {

std::optional<int64_t> Tensor::NumElements() const { return NumElementsOf(shape); }

std::optional<int64_t> NumElementsOf(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    if (dim != 0 && count > std::numeric_limits<int64_t>::max() / dim) return std::nullopt;
    count *= dim;
  }
  return count;
}

std::optional<size_t> DatatypeByteSize(std::string_view datatype) {
  if (datatype == "BOOL" || datatype == "UINT8" || datatype == "INT8") return 1;
  if (datatype == "UINT16" || datatype == "INT16" || datatype == "FP16" || datatype == "BF16") {
    return 2;
  }
  if (datatype == "UINT32" || datatype == "INT32" || datatype == "FP32") return 4;
  if (datatype == "UINT64" || datatype == "INT64" || datatype == "FP64") return 8;
  return std::nullopt;
}

float HalfBitsToFloat(uint16_t bits) {
  const bool negative = (bits & 0x8000u) != 0;
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  }
  return negative ? -magnitude : magnitude;
}

namespace {

// Shifts `value` right by `shift` bits, rounding to nearest, ties to even.
uint32_t ShiftRightRoundEven(uint32_t value, int shift) {
  if (shift <= 0) return value;
  if (shift > 31) return 0;
  const uint32_t kept = value >> shift;
  const uint32_t rest = value & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  return (rest > half || (rest == half && (kept & 1u))) ? kept + 1 : kept;
}

}  // namespace

uint16_t FloatToHalfBits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;  // NaN
  const int exponent = static_cast<int>(magnitude >> 23) - 127 + 15;
  if (exponent >= 31) return sign | 0x7c00u;  // too large (or infinite): infinity
  if (exponent <= 0) {
    // Subnormal in half precision; a carry out of the mantissa correctly
    // produces the smallest normal.
    if (magnitude == 0) return sign;
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    return sign | static_cast<uint16_t>(ShiftRightRoundEven(mantissa, 14 - exponent));
  }
  // Normal: a mantissa carry rolls into the exponent, and past the largest
  // finite value into infinity (0x7c00), as IEEE rounding requires.
  const uint32_t packed = (static_cast<uint32_t>(exponent) << 23) | (magnitude & 0x7fffffu);
  return sign | static_cast<uint16_t>(ShiftRightRoundEven(packed, 13));
}

float Bf16BitsToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

uint16_t FloatToBf16Bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>(ShiftRightRoundEven(bits, 16));
}

absl::StatusOr<std::vector<float>> TensorToFloats(const Tensor& tensor) {
  const std::optional<int64_t> count = tensor.NumElements();
  if (!count) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid tensor shape [", absl::StrJoin(tensor.shape, ","), "]"));
  }
  const std::optional<size_t> element_size = DatatypeByteSize(tensor.datatype);
  if (tensor.datatype != "FP32" && tensor.datatype != "FP16" && tensor.datatype != "BF16") {
    return absl::InvalidArgumentError(absl::StrCat(
        "datatype ", tensor.datatype, " is not a floating-point type (FP32, FP16, BF16)"));
  }
  if (tensor.data.size() != static_cast<size_t>(*count) * *element_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor data has ", tensor.data.size(), " bytes, shape [", absl::StrJoin(tensor.shape, ","),
        "] of ", tensor.datatype, " needs ", static_cast<size_t>(*count) * *element_size));
  }
  std::vector<float> values(static_cast<size_t>(*count));
  const char* src = tensor.data.data();
  if (tensor.datatype == "FP32") {
    std::memcpy(values.data(), src, values.size() * sizeof(float));
    return values;
  }
  const bool is_half = tensor.datatype == "FP16";
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    values[i] = is_half ? HalfBitsToFloat(bits) : Bf16BitsToFloat(bits);
  }
  return values;
}

absl::StatusOr<Tensor> FloatsToTensor(std::span<const float> values, std::vector<int64_t> shape,
                                      std::string_view datatype) {
  Tensor tensor{std::string(datatype), std::move(shape), {}};
  const std::optional<int64_t> count = tensor.NumElements();
  if (!count || static_cast<size_t>(*count) != values.size()) {
    return absl::InvalidArgumentError(absl::StrCat("shape [", absl::StrJoin(tensor.shape, ","),
                                                   "] does not hold ", values.size(), " values"));
  }
  if (datatype == "FP32") {
    tensor.data.resize(values.size() * sizeof(float));
    std::memcpy(tensor.data.data(), values.data(), tensor.data.size());
    return tensor;
  }
  if (datatype != "FP16" && datatype != "BF16") {
    return absl::InvalidArgumentError(
        absl::StrCat("datatype ", std::string(datatype), " is not one of FP32, FP16, BF16"));
  }
  const bool is_half = datatype == "FP16";
  // Exponent bits all set: infinity or NaN.
  const uint16_t exponent = is_half ? 0x7C00 : 0x7F80;
  tensor.data.resize(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = is_half ? FloatToHalfBits(values[i]) : FloatToBf16Bits(values[i]);
    if ((bits & exponent) == exponent && std::isfinite(values[i])) {
      return absl::InvalidArgumentError(absl::StrCat("element ", i, " (", values[i],
                                                     ") is outside ", std::string(datatype),
                                                     "'s range", is_half ? " (+-65504)" : ""));
    }
    std::memcpy(tensor.data.data() + 2 * i, &bits, 2);
  }
  return tensor;
}

}  // namespace layerserve::client
