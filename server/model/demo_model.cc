// The built-in demo model (DemoConfig, MakeDemoModel in model.h): a small
// Llama-shaped span whose weights come from a fixed-seed splitmix64 stream, so
// tests, benchmarks and two servers splitting the layers between them all see
// the same numbers on every machine.
//
// Each tensor's stream is seeded from its absolute layer index and its role,
// never from its position in the requested range: layers 2:4 served alone
// equal layers 2 and 3 of a 0:4 server, so spans compose into the full model.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "server/model/model.h"

namespace layerserve {
namespace {

constexpr uint64_t kDemoSeed = 0x6c61796572736572ull;  // "layerser"

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    state_ += 0x9e3779b97f4a7c15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  // Uniform in [-1, 1), from the top 24 bits: exact in float32, so no libm or
  // rounding-mode dependence.
  float Uniform() {
    const float unit = static_cast<float>(Next() >> 40) * 0x1p-24f;
    return 2.0f * unit - 1.0f;
  }

 private:
  uint64_t state_;
};

HostTensor MakeF32Tensor(std::vector<int64_t> shape, const std::vector<float>& values) {
  HostTensor t;
  t.dtype = DType::kF32;
  t.shape = std::move(shape);
  t.data.resize(values.size() * sizeof(float));
  std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}

// Tensor roles, part of each stream's seed.
enum class Role : uint64_t { kInputNorm = 1, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown };

SplitMix64 StreamFor(int64_t layer, Role role) {
  SplitMix64 mix(kDemoSeed ^ (static_cast<uint64_t>(layer) << 8) ^ static_cast<uint64_t>(role));
  return SplitMix64(mix.Next());
}

// uniform(-1, 1) / sqrt(fan_in): each output has variance ~ |x|^2 / (3 fan_in)
// of its input, so activations stay O(1) through the residual stream.
HostTensor Linear(int64_t layer, Role role, int64_t out_features, int64_t in_features) {
  SplitMix64 rng = StreamFor(layer, role);
  const float scale = 1.0f / std::sqrt(static_cast<float>(in_features));
  std::vector<float> w(static_cast<size_t>(out_features * in_features));
  for (float& v : w) v = rng.Uniform() * scale;
  return MakeF32Tensor({out_features, in_features}, w);
}

// 1 + uniform(-0.1, 0.1): near the identity, but not exactly, so a norm that
// ignored its weight would fail the tests.
HostTensor Norm(int64_t layer, Role role, int64_t size) {
  SplitMix64 rng = StreamFor(layer, role);
  std::vector<float> w(static_cast<size_t>(size));
  for (float& v : w) v = 1.0f + 0.1f * rng.Uniform();
  return MakeF32Tensor({size}, w);
}

}  // namespace

LlamaConfig DemoConfig() {
  LlamaConfig c;
  c.model_type = "llama";
  c.hidden_size = 512;
  c.intermediate_size = 1408;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.num_hidden_layers = 4;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.attention_bias = false;
  c.torch_dtype = "float32";
  return c;
}

// MakeDemoModel cannot fail, so an out-of-range `range` is clamped to the
// demo's layers; callers that take a user-supplied range check it against
// DemoConfig().num_hidden_layers first.
ModelSpan MakeDemoModel(const LayerRange& range, std::string model_name) {
  ModelSpan span;
  span.name = std::move(model_name);
  span.config = DemoConfig();
  const LlamaConfig& c = span.config;
  const int64_t begin = std::clamp<int64_t>(range.begin.value_or(0), 0, c.num_hidden_layers);
  const int64_t end =
      std::clamp<int64_t>(range.end.value_or(c.num_hidden_layers), begin, c.num_hidden_layers);
  span.first_layer = begin;
  const int64_t q_dim = c.num_attention_heads * c.head_dim;
  const int64_t kv_dim = c.num_key_value_heads * c.head_dim;
  for (int64_t layer = begin; layer < end; ++layer) {
    LayerWeights w;
    w.input_layernorm = Norm(layer, Role::kInputNorm, c.hidden_size);
    w.q_proj = Linear(layer, Role::kQ, q_dim, c.hidden_size);
    w.k_proj = Linear(layer, Role::kK, kv_dim, c.hidden_size);
    w.v_proj = Linear(layer, Role::kV, kv_dim, c.hidden_size);
    w.o_proj = Linear(layer, Role::kO, c.hidden_size, q_dim);
    w.post_attention_layernorm = Norm(layer, Role::kPostNorm, c.hidden_size);
    w.gate_proj = Linear(layer, Role::kGate, c.intermediate_size, c.hidden_size);
    w.up_proj = Linear(layer, Role::kUp, c.intermediate_size, c.hidden_size);
    w.down_proj = Linear(layer, Role::kDown, c.hidden_size, c.intermediate_size);
    span.layers.push_back(std::move(w));
  }
  return span;
}

}  // namespace layerserve
