// The device form of an FP8 checkpoint's linear weights, as the FP8 GEMM
// (kernels/include/layerserve/kernels/gemm.h, Fp8Scaling) reads them: the
// e4m3 codes of the projections that read one input stacked into one weight
// (q, k, v; gate and up, interleaved by kFp8GateUpBlock), and their scales in
// the GEMM's layout, per row or per 64 rows x 128 columns. Built on the host
// from the loaded tensors (server/model), which keep the checkpoint's own
// scale blocks; DeviceWeights uploads the result.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "layerserve/kernels/gemm.h"
#include "server/model/model.h"

namespace layerserve::cuda {

// How an FP8 checkpoint's linears run on the GPU: block-128 scaling for the
// fine-grained format (128 x 128 weight blocks, activations per token and
// 128 channels), per-row scaling for per-channel or per-tensor weights with
// activations per token or at a static scale. UNIMPLEMENTED, naming the
// format, for anything else (weight-only FP8, other block shapes): the CPU
// backend serves those, and a silent change of numerics is never an option.
absl::StatusOr<kernels::Fp8Scaling> CudaFp8Scaling(const Fp8Quantization& q);

struct Fp8LinearImage {
  std::vector<uint8_t> codes;  // [rows, cols] e4m3
  std::vector<float> scales;   // GemmParams::w_scale's layout for the scaling
  // Block scaling: GemmParams::w_scale_128 (cuBLASLt's layout), where every
  // 128-row block's two 64-row halves carry the same scales; else empty.
  std::vector<float> scales_128;
  float input_scale = 0;  // the static activation scale (> 0), else 0
  // Floats from the start of `scales` to scales_128 where both lie in one
  // device region (256-byte aligned, as DeviceWeights places them).
  size_t scales_128_at() const { return (scales.size() + 63) / 64 * 64; }
  size_t scale_floats() const {
    return scales_128.empty() ? scales.size() : scales_128_at() + scales_128.size();
  }
};

// Stacks `parts` (FP8 tensors [rows_i, cols] of one input width) into one
// weight; with `gate_up` the two parts are gate and up, interleaved as
// kernels::Fp8GateUpRow says. INVALID_ARGUMENT for a part that is not FP8 or
// does not fit the others; UNIMPLEMENTED where its scale blocks do not fit
// `scaling` or a block-scaled part's rows are not a multiple of 64. `name`
// labels errors ("layer 3 q_proj, k_proj and v_proj").
absl::StatusOr<Fp8LinearImage> MakeFp8LinearImage(std::initializer_list<const HostTensor*> parts,
                                                  kernels::Fp8Scaling scaling, bool gate_up,
                                                  const std::string& name);

// A mixture of experts' stacked FP8 weight ([experts, rows, cols], one scale
// grid per expert, as the loader holds it) as the grouped FP8 GEMM reads it:
// each expert's image (MakeFp8LinearImage) one after the other, codes and
// scales alike; with `gate_up` each expert's rows are its gate rows then its
// up rows, interleaved per expert. UNIMPLEMENTED where gate and up share a
// scale block (the intermediate width is not a multiple of the block rows).
absl::StatusOr<Fp8LinearImage> MakeFp8ExpertsImage(const HostTensor& stacked,
                                                   kernels::Fp8Scaling scaling, bool gate_up,
                                                   const std::string& name);

}  // namespace layerserve::cuda
