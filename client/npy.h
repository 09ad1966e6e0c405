// Reading and writing NumPy .npy files (format versions 1.0, 2.0 and 3.0),
// so `layerctl infer` can take inputs from and hand outputs back to Python.
//
// Supported: little-endian `<f4` (FP32), `<f2` (FP16) and `<u2`, C order.
// NumPy has no bfloat16 dtype, so BF16 tensors are stored as `<u2` arrays whose
// elements are the raw bf16 bit patterns (the convention of torch's
// `tensor.view(torch.uint16).numpy()` and of ml_dtypes users who save with
// `.view(np.uint16)`); `<u2` is therefore read back as BF16. Fortran order,
// big-endian data, object arrays and other dtypes are rejected with
// INVALID_ARGUMENT naming what was found.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/tensor.h"

namespace layerserve::client {

struct NpyArray {
  std::string descr;           // "<f4", "<f2" or "<u2"
  std::vector<int64_t> shape;  // C order; () is a scalar with one element
  std::string data;            // element bytes, little-endian, no padding
};

// Parses the bytes of a whole .npy file.
absl::StatusOr<NpyArray> ParseNpy(std::string_view bytes);
// Serializes as version 1.0, or 2.0 when the header needs more than 65535
// bytes; the header is padded so the data starts at a multiple of 64 bytes.
absl::StatusOr<std::string> SerializeNpy(const NpyArray& array);

// File wrappers; errors name the path.
absl::StatusOr<NpyArray> ReadNpyFile(const std::filesystem::path& path);
absl::Status WriteNpyFile(const std::filesystem::path& path, const NpyArray& array);

// The protocol datatype an npy dtype maps to: <f4 -> FP32, <f2 -> FP16,
// <u2 -> BF16 (bit patterns, see above).
absl::StatusOr<std::string> DatatypeForDescr(std::string_view descr);
// The inverse: FP32 -> <f4, FP16 -> <f2, BF16 -> <u2.
absl::StatusOr<std::string> DescrForDatatype(std::string_view datatype);

// Array -> tensor of its natural datatype, or, if `datatype` is given and
// differs, with the values converted to it (through float32).
absl::StatusOr<Tensor> NpyToTensor(const NpyArray& array,
                                   std::optional<std::string_view> datatype = std::nullopt);
absl::StatusOr<NpyArray> TensorToNpy(const Tensor& tensor);

}  // namespace layerserve::client
