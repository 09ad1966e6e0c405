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

// cuBLASLt's block scales (GemmParams::w_scale_128) of an image's 64-row
// ones, `rows` x `cols` codes; empty where two halves of a 128-row block
// differ.
std::vector<float> CublasLtBlockScales(const std::vector<float>& scales, int64_t rows,
                                       int64_t cols) {
  const int64_t kblocks = (cols + kernels::kFp8BlockK - 1) / kernels::kFp8BlockK;
  const int64_t groups = rows / kernels::kFp8WeightScaleRows;
  const int64_t padded = kernels::kFp8CublasLtScaleCols(cols);
  const int64_t blocks = (rows + kernels::kFp8BlockK - 1) / kernels::kFp8BlockK;
  std::vector<float> out(static_cast<size_t>(blocks * padded), 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const float first = scales[static_cast<size_t>(2 * b * kblocks + kb)];
      if (2 * b + 1 < groups && scales[static_cast<size_t>((2 * b + 1) * kblocks + kb)] != first) {
        return {};
      }
      out[static_cast<size_t>(b * padded + kb)] = first;
    }
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
  const int64_t rows = static_cast<int64_t>(image.codes.size()) / cols;
  const auto with_cublaslt_scales = [&]() -> Fp8LinearImage {
    if (scaling == Fp8Scaling::kBlock) {
      image.scales_128 = CublasLtBlockScales(image.scales, rows, cols);
    }
    return std::move(image);
  };
  if (!gate_up) return with_cublaslt_scales();

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
  return with_cublaslt_scales();
}

namespace {

// Rows [row0, row0 + rows) of expert e of a stacked FP8 tensor [experts, R,
// C], as a 2-D FP8 tensor with its own scales: one per row where a scale
// block spans the columns (per channel or per tensor), else the blocks of
// those rows (row0 must start a block).
absl::StatusOr<HostTensor> ExpertRows(const HostTensor& t, int64_t e, int64_t row0, int64_t rows,
                                      const std::string& name) {
  const int64_t all_rows = t.shape[1];
  const int64_t cols = t.shape[2];
  const HostTensor::ScaleGrid grid = t.Fp8ScaleGrid();
  HostTensor out;
  out.dtype = DType::kF8E4M3;
  out.shape = {rows, cols};
  out.input_scale = t.input_scale;
  const auto* from = t.data.data() + static_cast<size_t>((e * all_rows + row0) * cols);
  out.data.assign(from, from + static_cast<size_t>(rows * cols));
  const float* scales = t.scale.data() + static_cast<size_t>(e * grid.rows * grid.cols);
  if (grid.cols == 1) {
    out.scale_block_rows = 1;
    out.scale_block_cols = cols;
    out.scale.resize(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r)
      out.scale[static_cast<size_t>(r)] = scales[(row0 + r) / t.scale_block_rows];
    return out;
  }
  if (row0 % t.scale_block_rows != 0) {
    return absl::UnimplementedError(absl::StrCat(
        "cuda backend: ", name, ": gate and up share a ", t.scale_block_rows, "-row scale block (",
        row0, " rows each); the grouped FP8 GEMM needs them in blocks of their own"));
  }
  out.scale_block_rows = t.scale_block_rows;
  out.scale_block_cols = t.scale_block_cols;
  const int64_t block0 = row0 / t.scale_block_rows;
  const int64_t blocks = (rows + t.scale_block_rows - 1) / t.scale_block_rows;
  out.scale.assign(scales + block0 * grid.cols, scales + (block0 + blocks) * grid.cols);
  return out;
}

}  // namespace

absl::StatusOr<Fp8LinearImage> MakeFp8ExpertsImage(const HostTensor& stacked, Fp8Scaling scaling,
                                                   bool gate_up, const std::string& name) {
  if (stacked.dtype != DType::kF8E4M3 || stacked.shape.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda backend: ", name, ": stacked FP8 experts must be [experts, rows, cols]"));
  }
  const int64_t experts = stacked.shape[0];
  const int64_t rows = stacked.shape[1];
  Fp8LinearImage image;
  image.input_scale = stacked.input_scale;
  for (int64_t e = 0; e < experts; ++e) {
    const std::string expert = absl::StrCat(name, " (expert ", e, ")");
    absl::StatusOr<Fp8LinearImage> one;
    if (gate_up) {
      absl::StatusOr<HostTensor> gate = ExpertRows(stacked, e, 0, rows / 2, expert);
      if (!gate.ok()) return gate.status();
      absl::StatusOr<HostTensor> up = ExpertRows(stacked, e, rows / 2, rows / 2, expert);
      if (!up.ok()) return up.status();
      one = MakeFp8LinearImage({&*gate, &*up}, scaling, true, expert);
    } else {
      absl::StatusOr<HostTensor> down = ExpertRows(stacked, e, 0, rows, expert);
      if (!down.ok()) return down.status();
      one = MakeFp8LinearImage({&*down}, scaling, false, expert);
    }
    if (!one.ok()) return one.status();
    image.codes.insert(image.codes.end(), one->codes.begin(), one->codes.end());
    image.scales.insert(image.scales.end(), one->scales.begin(), one->scales.end());
  }
  return image;
}

}  // namespace layerserve::cuda
