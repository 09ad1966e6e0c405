// Seeded random models for backend tests: a portable generator (the same
// numbers under every standard library) and a decoder-layer span of random
// weights for any LlamaConfig, stored in any dtype. The CPU backend tests and
// the CUDA backend tests build their models from the same code.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "server/model/model.h"

namespace layerserve::test_support {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    state_ += 0x9e3779b97f4a7c15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi).
  double Uniform(double lo, double hi) {
    return lo + (hi - lo) * static_cast<double>(Next() >> 11) * 0x1p-53;
  }

 private:
  uint64_t state_;
};

// A tensor of `shape` with values uniform in [lo, hi), stored as `dtype`.
inline HostTensor RandomTensor(Rng& rng, std::vector<int64_t> shape, double lo, double hi,
                               DType dtype) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  std::vector<float> values(static_cast<size_t>(t.NumElements()));
  for (float& v : values) v = static_cast<float>(rng.Uniform(lo, hi));
  t.data.resize(values.size() * DTypeSize(dtype));
  ConvertFromFloat(values.data(), values.size(), dtype, t.data.data());
  return t;
}

// Layers [first_layer, first_layer + num_layers) of a model with config `c`:
// linear weights uniform in +-1/sqrt(fan_in), norms near 1, biases (when
// c.attention_bias) in +-0.5. A mixture of experts gets a router four times
// that scale, so that routing margins are wide and a lower-precision backend
// rarely ties (tests still check the margin of their inputs).
inline ModelSpan RandomModel(const LlamaConfig& c, int64_t first_layer, int64_t num_layers,
                             DType weight_dtype, uint64_t seed) {
  Rng rng(seed);
  ModelSpan span;
  span.name = "random";
  span.config = c;
  span.first_layer = first_layer;
  const int64_t q = c.num_attention_heads * c.head_dim;
  const int64_t kv = c.num_key_value_heads * c.head_dim;
  const auto linear = [&](int64_t out, int64_t in) {
    const double s = 1.0 / std::sqrt(static_cast<double>(in));
    return RandomTensor(rng, {out, in}, -s, s, weight_dtype);
  };
  for (int64_t l = 0; l < num_layers; ++l) {
    LayerWeights w;
    w.input_layernorm = RandomTensor(rng, {c.hidden_size}, 0.8, 1.2, weight_dtype);
    w.q_proj = linear(q, c.hidden_size);
    w.k_proj = linear(kv, c.hidden_size);
    w.v_proj = linear(kv, c.hidden_size);
    if (c.attention_bias) {
      w.q_bias = RandomTensor(rng, {q}, -0.5, 0.5, weight_dtype);
      w.k_bias = RandomTensor(rng, {kv}, -0.5, 0.5, weight_dtype);
      w.v_bias = RandomTensor(rng, {kv}, -0.5, 0.5, weight_dtype);
    }
    if (c.qk_norm) {
      w.q_norm = RandomTensor(rng, {c.head_dim}, 0.8, 1.2, weight_dtype);
      w.k_norm = RandomTensor(rng, {c.head_dim}, 0.8, 1.2, weight_dtype);
    }
    w.o_proj = linear(c.hidden_size, q);
    w.post_attention_layernorm = RandomTensor(rng, {c.hidden_size}, 0.8, 1.2, weight_dtype);
    if (c.IsMixtureOfExperts()) {
      const double s = 4.0 / std::sqrt(static_cast<double>(c.hidden_size));
      w.router = RandomTensor(rng, {c.num_experts, c.hidden_size}, -s, s, weight_dtype);
      const double sg = 1.0 / std::sqrt(static_cast<double>(c.hidden_size));
      w.experts_gate_up = RandomTensor(rng, {c.num_experts, 2 * c.intermediate_size, c.hidden_size},
                                       -sg, sg, weight_dtype);
      const double sd = 1.0 / std::sqrt(static_cast<double>(c.intermediate_size));
      w.experts_down = RandomTensor(rng, {c.num_experts, c.hidden_size, c.intermediate_size}, -sd,
                                    sd, weight_dtype);
      if (c.HasSharedExpert()) {
        const int64_t shared = c.shared_expert_intermediate_size;
        w.shared_gate_proj = linear(shared, c.hidden_size);
        w.shared_up_proj = linear(shared, c.hidden_size);
        w.shared_down_proj = linear(c.hidden_size, shared);
        w.shared_expert_gate = linear(1, c.hidden_size);
      }
    } else {
      w.gate_proj = linear(c.intermediate_size, c.hidden_size);
      w.up_proj = linear(c.intermediate_size, c.hidden_size);
      w.down_proj = linear(c.hidden_size, c.intermediate_size);
    }
    span.layers.push_back(std::move(w));
  }
  return span;
}

}  // namespace layerserve::test_support
