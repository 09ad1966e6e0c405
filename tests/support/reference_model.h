// A ModelSpan as the float64 reference's layers (tests/reference): weights
// decoded here, not with the server's conversion code, and the reference run
// over a span layer by layer, each with its own sliding window. The CPU and
// CUDA backend tests compare against it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "base/dtype.h"
#include "gtest/gtest.h"
#include "server/model/model.h"
#include "tests/reference/llama_reference.h"

namespace layerserve::test_support {

// Decodes a weight tensor here rather than with HostTensor::ToFloat, so the
// reference does not share the server's conversion code.
inline std::vector<double> DecodeWeights(const HostTensor& t) {
  std::vector<double> out;
  if (t.dtype == DType::kF8E4M3) {
    // e4m3fn bits by hand (sign, 4 exponent bits biased by 7, 3 mantissa
    // bits; exponent 0 is subnormal), times the scale of the element's
    // block (HostTensor::scale), in double.
    const int64_t rows = t.shape[t.shape.size() - 2];
    const int64_t cols = t.shape.back();
    const int64_t grid_rows = (rows + t.scale_block_rows - 1) / t.scale_block_rows;
    const int64_t grid_cols = (cols + t.scale_block_cols - 1) / t.scale_block_cols;
    for (size_t i = 0; i < t.data.size(); ++i) {
      const unsigned b = t.data[i];
      const int exponent = static_cast<int>((b >> 3) & 15u);
      const double mantissa = static_cast<double>(b & 7u);
      double v =
          exponent == 0 ? std::ldexp(mantissa, -9) : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
      if ((b & 0x80u) != 0) v = -v;
      const int64_t lead = static_cast<int64_t>(i) / (rows * cols);
      const int64_t r = static_cast<int64_t>(i) / cols % rows;
      const int64_t c = static_cast<int64_t>(i) % cols;
      const size_t block = static_cast<size_t>(
          (lead * grid_rows + r / t.scale_block_rows) * grid_cols + c / t.scale_block_cols);
      out.push_back(v * static_cast<double>(t.scale.at(block)));
    }
    return out;
  }
  if (t.dtype == DType::kF32) {
    for (size_t i = 0; i < t.data.size(); i += 4) {
      float f;
      std::memcpy(&f, &t.data[i], 4);
      out.push_back(f);
    }
  } else {
    EXPECT_EQ(t.dtype, DType::kBF16) << "test models use F32 or BF16 weights";
    for (size_t i = 0; i < t.data.size(); i += 2) {
      const uint32_t bits =
          (static_cast<uint32_t>(t.data[i + 1]) << 24) | (static_cast<uint32_t>(t.data[i]) << 16);
      float f;
      std::memcpy(&f, &bits, 4);
      out.push_back(f);
    }
  }
  return out;
}

// The activation quantization in front of a projection with weight `w`: the
// checkpoint format's (Fp8Quantization) when `w` is FP8, none otherwise.
inline reference::InputQuant InputQuantOf(const HostTensor& w, const LlamaConfig& c) {
  reference::InputQuant q;
  if (w.dtype != DType::kF8E4M3 || !c.fp8) return q;
  switch (c.fp8->activations) {
    case Fp8Quantization::Activations::kPerTokenGroup:
      q.enabled = true;
      q.group = c.fp8->activation_group;
      break;
    case Fp8Quantization::Activations::kPerToken:
      q.enabled = true;
      break;
    case Fp8Quantization::Activations::kStaticPerTensor:
      q.enabled = true;
      q.static_scale = w.input_scale;
      break;
    case Fp8Quantization::Activations::kNone:
      break;
  }
  return q;
}

struct ReferenceModel {
  reference::Config config;
  std::vector<reference::Layer> layers;
  std::vector<int64_t> windows;  // per layer: sliding window, 0 for full causal
};

inline ReferenceModel ToReference(const ModelSpan& span) {
  const LlamaConfig& c = span.config;
  ReferenceModel m;
  m.config.hidden = c.hidden_size;
  m.config.intermediate = c.intermediate_size;
  m.config.heads = c.num_attention_heads;
  m.config.kv_heads = c.num_key_value_heads;
  m.config.head_dim = c.head_dim;
  // The server adds eps in float32, as torch does.
  m.config.rms_norm_eps = static_cast<float>(c.rms_norm_eps);
  m.config.rope_theta = c.rope_theta;
  m.config.experts = c.num_experts;
  m.config.top_k = c.experts_per_token;
  m.config.normalize_top_k = c.normalize_top_k;
  m.config.shared_intermediate = c.shared_expert_intermediate_size;
  m.config.qk_norm = c.qk_norm;
  if (c.rope_scaling) {
    m.config.llama3 = true;
    m.config.llama3_factor = c.rope_scaling->factor;
    m.config.llama3_low_freq_factor = c.rope_scaling->low_freq_factor;
    m.config.llama3_high_freq_factor = c.rope_scaling->high_freq_factor;
    m.config.llama3_original_max_positions =
        static_cast<double>(c.rope_scaling->original_max_position_embeddings);
  }
  for (size_t i = 0; i < span.layers.size(); ++i) {
    const LayerWeights& w = span.layers[i];
    m.windows.push_back(c.AttentionWindow(span.first_layer + static_cast<int64_t>(i)));
    reference::Layer l;
    l.input_norm = DecodeWeights(w.input_layernorm);
    l.wq = DecodeWeights(w.q_proj);
    l.wk = DecodeWeights(w.k_proj);
    l.wv = DecodeWeights(w.v_proj);
    l.bq = DecodeWeights(w.q_bias);
    l.bk = DecodeWeights(w.k_bias);
    l.bv = DecodeWeights(w.v_bias);
    l.q_norm = DecodeWeights(w.q_norm);
    l.k_norm = DecodeWeights(w.k_norm);
    l.wo = DecodeWeights(w.o_proj);
    l.post_norm = DecodeWeights(w.post_attention_layernorm);
    l.wgate = DecodeWeights(w.gate_proj);
    l.wup = DecodeWeights(w.up_proj);
    l.wdown = DecodeWeights(w.down_proj);
    l.router = DecodeWeights(w.router);
    l.experts_gate_up = DecodeWeights(w.experts_gate_up);
    l.experts_down = DecodeWeights(w.experts_down);
    l.shared_wgate = DecodeWeights(w.shared_gate_proj);
    l.shared_wup = DecodeWeights(w.shared_up_proj);
    l.shared_wdown = DecodeWeights(w.shared_down_proj);
    l.shared_gate = DecodeWeights(w.shared_expert_gate);
    l.qkv_input = InputQuantOf(w.q_proj, c);
    l.o_input = InputQuantOf(w.o_proj, c);
    l.gate_up_input = InputQuantOf(w.gate_proj, c);
    l.down_input = InputQuantOf(w.down_proj, c);
    l.experts_gate_up_input = InputQuantOf(w.experts_gate_up, c);
    l.experts_down_input = InputQuantOf(w.experts_down, c);
    l.shared_gate_up_input = InputQuantOf(w.shared_gate_proj, c);
    l.shared_gate_input = InputQuantOf(w.shared_expert_gate, c);
    l.shared_down_input = InputQuantOf(w.shared_down_proj, c);
    m.layers.push_back(std::move(l));
  }
  return m;
}

inline std::vector<double> ReferenceForward(const ReferenceModel& m, std::vector<double> x,
                                            const std::vector<int32_t>& cu_seqlens) {
  reference::Config config = m.config;
  for (size_t i = 0; i < m.layers.size(); ++i) {
    config.sliding_window = m.windows[i];
    x = reference::DecoderLayer(x, cu_seqlens, config, m.layers[i]);
  }
  return x;
}

// `m` with every projection's input left unquantized: the weight-only (W8A16)
// reference of an FP8 model, which a backend that skipped or misplaced an
// activation quantization would approach.
inline ReferenceModel WeightOnly(ReferenceModel m) {
  for (reference::Layer& l : m.layers) {
    for (reference::InputQuant* q :
         {&l.qkv_input, &l.o_input, &l.gate_up_input, &l.down_input, &l.experts_gate_up_input,
          &l.experts_down_input, &l.shared_gate_up_input, &l.shared_down_input,
          &l.shared_gate_input}) {
      q->enabled = false;
    }
  }
  return m;
}

// ||got - want|| / ||want||.
template <typename T>
double RelativeError(const std::vector<T>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

}  // namespace layerserve::test_support
