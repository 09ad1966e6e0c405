// FP8 test models: a span's projections quantized to float8_e4m3fn the way
// the checkpoint formats quantize them (one scale per block of the weight,
// amax / 448, the values rounded to nearest even), with the format's
// activation quantization in its config. The CPU backend tests, the loader
// tests and (later) the CUDA ones build their FP8 models here.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "base/dtype.h"
#include "server/model/model.h"

namespace layerserve::test_support {

// The configurations the formats write (Fp8Quantization).
inline Fp8Quantization FineGrainedFp8(int64_t block = 128) {
  Fp8Quantization q;
  q.format = Fp8Quantization::Format::kFineGrained;
  q.activations = Fp8Quantization::Activations::kPerTokenGroup;
  q.activation_group = block;
  q.weight_block_rows = block;
  q.weight_block_cols = block;
  return q;
}
inline Fp8Quantization PerChannelFp8(
    Fp8Quantization::Activations activations = Fp8Quantization::Activations::kPerToken) {
  Fp8Quantization q;
  q.format = Fp8Quantization::Format::kCompressedTensors;
  q.activations = activations;
  q.weight_block_rows = 1;
  q.weight_block_cols = 0;
  return q;
}
inline Fp8Quantization PerTensorStaticFp8() {
  Fp8Quantization q = PerChannelFp8(Fp8Quantization::Activations::kStaticPerTensor);
  q.weight_block_rows = 0;
  return q;
}

// `t` (any dtype, [..., rows, cols]) as an FP8 weight with scales in blocks
// of `block_rows` x `block_cols` (0: the whole dimension).
inline HostTensor QuantizeWeightFp8(const HostTensor& t, int64_t block_rows, int64_t block_cols) {
  const int64_t rows = t.shape[t.shape.size() - 2];
  const int64_t cols = t.shape.back();
  const int64_t lead = t.NumElements() / (rows * cols);
  HostTensor q;
  q.dtype = DType::kF8E4M3;
  q.shape = t.shape;
  q.scale_block_rows = block_rows > 0 ? block_rows : rows;
  q.scale_block_cols = block_cols > 0 ? block_cols : cols;
  const int64_t grid_rows = (rows + q.scale_block_rows - 1) / q.scale_block_rows;
  const int64_t grid_cols = (cols + q.scale_block_cols - 1) / q.scale_block_cols;
  const std::vector<float> w = t.ToFloat();
  q.data.resize(w.size());
  q.scale.assign(static_cast<size_t>(lead * grid_rows * grid_cols), 0.0f);
  auto block_of = [&](int64_t i) {
    const int64_t l = i / (rows * cols), r = i / cols % rows, c = i % cols;
    return static_cast<size_t>((l * grid_rows + r / q.scale_block_rows) * grid_cols +
                               c / q.scale_block_cols);
  };
  for (int64_t i = 0; i < static_cast<int64_t>(w.size()); ++i) {
    float& amax = q.scale[block_of(i)];
    amax = std::max(amax, std::fabs(w[static_cast<size_t>(i)]));
  }
  for (float& s : q.scale) s = s > 0 ? s / kFp8E4M3Max : 1.0f;
  for (int64_t i = 0; i < static_cast<int64_t>(w.size()); ++i) {
    q.data[static_cast<size_t>(i)] =
        FloatToFp8E4M3(w[static_cast<size_t>(i)] / q.scale[block_of(i)]);
  }
  return q;
}

// Quantizes every projection of `span` (attention, MLP, experts, shared
// expert and its sigmoid gate; never norms, biases or routers) as `fp8` says and sets
// span.config.fp8, leaving the projections in `keep` as they are (a
// checkpoint's ignored modules). Static activation scales (kStaticPerTensor)
// are `static_scale` for the projections that read the normed hidden states
// and a quarter of it for o and down.
inline void QuantizeSpanFp8(ModelSpan& span, const Fp8Quantization& fp8,
                            const std::vector<const HostTensor*>& keep = {},
                            float static_scale = 4.0f / kFp8E4M3Max) {
  span.config.fp8 = fp8;
  for (LayerWeights& w : span.layers) {
    const struct {
      HostTensor* tensor;
      float input_scale;
    } projections[] = {
        {&w.q_proj, static_scale},
        {&w.k_proj, static_scale},
        {&w.v_proj, static_scale},
        {&w.o_proj, static_scale / 4},
        {&w.gate_proj, static_scale},
        {&w.up_proj, static_scale},
        {&w.down_proj, static_scale / 4},
        {&w.experts_gate_up, static_scale},
        {&w.experts_down, static_scale / 4},
        {&w.shared_gate_proj, static_scale},
        {&w.shared_up_proj, static_scale},
        {&w.shared_down_proj, static_scale / 4},
        {&w.shared_expert_gate, static_scale},
    };
    for (const auto& p : projections) {
      if (p.tensor->data.empty()) continue;
      if (std::find(keep.begin(), keep.end(), p.tensor) != keep.end()) continue;
      *p.tensor = QuantizeWeightFp8(*p.tensor, fp8.weight_block_rows, fp8.weight_block_cols);
      if (fp8.activations == Fp8Quantization::Activations::kStaticPerTensor) {
        p.tensor->input_scale = p.input_scale;
      }
    }
  }
}

}  // namespace layerserve::test_support
