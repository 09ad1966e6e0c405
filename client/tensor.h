// The client's view of a tensor on the wire: an Open Inference Protocol
// datatype string, a shape and the raw little-endian bytes, exactly as they
// travel in raw_input_contents / raw_output_contents.
//
// The client deliberately does not share the server's dtype code (client/ may
// depend on proto/ only), so the element conversions the CLI and the bench
// need (FP32 <-> FP16 / BF16, round-to-nearest-even) live here.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace layerserve::client {

struct Tensor {
  std::string datatype;        // "FP32", "FP16", "BF16", ... (protocol spelling)
  std::vector<int64_t> shape;  // row-major
  std::string data;            // NumElements() * element size bytes, no padding

  // NumElementsOf(shape).
  std::optional<int64_t> NumElements() const;
};

// Product of `shape`; nullopt if a dimension is negative or it overflows
// int64.
std::optional<int64_t> NumElementsOf(const std::vector<int64_t>& shape);

// Bytes per element of a protocol datatype ("FP32" -> 4, "BF16" -> 2, ...);
// nullopt for BYTES (variable length) and unknown names.
std::optional<size_t> DatatypeByteSize(std::string_view datatype);

// Scalar conversions, round-to-nearest-even; NaN stays NaN, overflow becomes
// infinity.
float HalfBitsToFloat(uint16_t bits);
uint16_t FloatToHalfBits(float value);
float Bf16BitsToFloat(uint16_t bits);
uint16_t FloatToBf16Bits(float value);

// Decodes an FP32, FP16 or BF16 tensor into floats. INVALID_ARGUMENT for other
// datatypes or a byte size that does not match the shape.
absl::StatusOr<std::vector<float>> TensorToFloats(const Tensor& tensor);

// Encodes floats as an FP32, FP16 or BF16 tensor of `shape` (whose element
// count must equal values.size()), rounding to nearest even. INVALID_ARGUMENT,
// naming the first such element, for a finite value the datatype cannot hold
// (beyond FP16's +-65504: it would become infinity); infinities and NaN stay
// what they are.
absl::StatusOr<Tensor> FloatsToTensor(std::span<const float> values, std::vector<int64_t> shape,
                                      std::string_view datatype);

}  // namespace layerserve::client
