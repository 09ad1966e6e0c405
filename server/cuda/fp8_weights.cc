// FP8 weight images (see fp8_weights.h): per part, its codes and its scales
// expanded to the GEMM's granularity (one per row, or one per 64 rows and
// 128-column block), stacked; gate/up then interleaved in 64-row groups.
#include "server/cuda/fp8_weights.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace layerserve::cuda {

using kernels::Fp8Scaling;

absl::StatusOr<Fp8Scaling> CudaFp8Scaling(const Fp8Quantization& q) {
  using Activations = Fp8Quantization::Activations;
  const auto unsupported = [&q](const char* why) {
    return absl::UnimplementedError(
        absl::StrCat("cuda backend: ", q.Describe(), ": ", why,
                     "; --backend=cpu serves it with the format's numerics"));
  };
  switch (q.activations) {
    case Activations::kNone:
      return unsupported("weight-only FP8 (activations not quantized) has no GPU kernel yet");
    case Activations::kPerTokenGroup:
      if (q.activation_group != kernels::kFp8BlockK || q.weight_block_rows != kernels::kFp8BlockK ||
          q.weight_block_cols != kernels::kFp8BlockK) {
        return unsupported(
            "the GPU kernel takes 128-channel activation groups and 128x128 weight blocks only");
      }
      return Fp8Scaling::kBlock;
    case Activations::kPerToken:
    case Activations::kStaticPerTensor:
      // Per-channel ({1, 0}) or per-tensor ({0, 0}) weight scales.
      if (q.weight_block_cols != 0 || (q.weight_block_rows != 0 && q.weight_block_rows != 1)) {
        return unsupported(
            "per-token activations need per-channel or per-tensor weight scales on the GPU");
      }
      return Fp8Scaling::kPerRow;
  }
  return unsupported("unknown activation scheme");
}

namespace {

// One part's scale rows at the GEMM's granularity: per row (one float each)
// or per 64-row group (kblocks floats each).
absl::StatusOr<std::vector<float>> ExpandScales(const HostTensor& t, Fp8Scaling scaling,
                                                const std::string& name) {
  const int64_t rows = t.shape[0];
  const int64_t cols = t.shape[1];
  const HostTensor::ScaleGrid grid = t.Fp8ScaleGrid();
  std::vector<float> out;
  if (scaling == Fp8Scaling::kPerRow) {
    if (grid.cols != 1) {
      return absl::UnimplementedError(absl::StrCat("cuda backend: ", name, ": scale blocks of ",
                                                   t.scale_block_rows, "x", t.scale_block_cols,
                                                   " where per-row scales were expected"));
    }
    out.resize(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r)
      out[r] = t.scale[static_cast<size_t>(r / t.scale_block_rows)];
    return out;
  }
  if (t.scale_block_rows != kernels::kFp8BlockK || t.scale_block_cols != kernels::kFp8BlockK) {
    return absl::UnimplementedError(absl::StrCat("cuda backend: ", name, ": scale blocks of ",
                                                 t.scale_block_rows, "x", t.scale_block_cols,
                                                 " where 128x128 blocks were expected"));
  }
  if (rows % kernels::kFp8WeightScaleRows != 0) {
    return absl::UnimplementedError(absl::StrCat(
        "cuda backend: ", name, ": ", rows,
        " rows; block-scaled FP8 on the GPU needs a multiple of ", kernels::kFp8WeightScaleRows));
  }
  const int64_t kblocks = (cols + kernels::kFp8BlockK - 1) / kernels::kFp8BlockK;
  const int64_t groups = rows / kernels::kFp8WeightScaleRows;
  out.resize(static_cast<size_t>(groups * kblocks));
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t block_row = g * kernels::kFp8WeightScaleRows / kernels::kFp8BlockK;
    for (int64_t kb = 0; kb < kblocks; ++kb)
      out[g * kblocks + kb] = t.scale[block_row * grid.cols + kb];
  }
  return out;
}

}  // namespace

absl::StatusOr<Fp8LinearImage> MakeFp8LinearImage(std::initializer_list<const HostTensor*> parts,
                                                  Fp8Scaling scaling, bool gate_up,
                                                  const std::string& name) {
  Fp8LinearImage image;
  const HostTensor& first = **parts.begin();
  if (first.shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: ", name, ": FP8 weights must be 2-D"));
  }
  const int64_t cols = first.shape[1];
  image.input_scale = first.input_scale;
  for (const HostTensor* t : parts) {
    if (t->dtype != DType::kF8E4M3 || t->shape.size() != 2 || t->shape[1] != cols) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda backend: ", name, ": parts of one FP8 weight must all be FP8 [rows, ", cols, "]"));
    }
    image.codes.insert(image.codes.end(), t->data.begin(), t->data.end());
    absl::StatusOr<std::vector<float>> scales = ExpandScales(*t, scaling, name);
    if (!scales.ok()) return scales.status();
    image.scales.insert(image.scales.end(), scales->begin(), scales->end());
  }
  if (!gate_up) return image;

  // Gate rows [0, width) then up rows: interleave rows and their scales.
  const int64_t width = first.shape[0];
  if (parts.size() != 2 || width % kernels::kFp8GateUpBlock != 0) {
    return absl::UnimplementedError(
        absl::StrCat("cuda backend: ", name, ": the FP8 gate/up needs two parts of a ",
                     "multiple of ", kernels::kFp8GateUpBlock, " rows"));
  }
  const std::vector<uint8_t> codes = image.codes;
  const std::vector<float> scales = image.scales;
  const size_t row_bytes = static_cast<size_t>(cols);
  const int64_t scale_row = scaling == Fp8Scaling::kPerRow ? 1 : kernels::kFp8WeightScaleRows;
  const size_t scale_floats = scales.size() / static_cast<size_t>(2 * width / scale_row);
  for (int64_t i = 0; i < width; ++i) {
    for (const bool up : {false, true}) {
      const int64_t from = (up ? width : 0) + i;
      const int64_t to = kernels::Fp8GateUpRow(i, up);
      std::memcpy(image.codes.data() + static_cast<size_t>(to) * row_bytes,
                  codes.data() + static_cast<size_t>(from) * row_bytes, row_bytes);
      if (from % scale_row == 0) {  // the first row of its scale row
        std::memcpy(image.scales.data() + static_cast<size_t>(to / scale_row) * scale_floats,
                    scales.data() + static_cast<size_t>(from / scale_row) * scale_floats,
                    scale_floats * sizeof(float));
      }
    }
  }
  return image;
}

}  // namespace layerserve::cuda
