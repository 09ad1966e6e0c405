// The demo model: its documented configuration, bit-identical weights on
// every call, spans that compose (layers 2:4 alone equal layers 2..3 of 0:4),
// and weight magnitudes that keep activations O(1).
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/model/model.h"

namespace layerserve {
namespace {

std::vector<const HostTensor*> Tensors(const LayerWeights& w) {
  return {&w.input_layernorm,          &w.q_proj,    &w.k_proj,  &w.v_proj,   &w.o_proj,
          &w.post_attention_layernorm, &w.gate_proj, &w.up_proj, &w.down_proj};
}

TEST(DemoModelTest, ConfigMatchesDocumentation) {
  const LlamaConfig c = DemoConfig();
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.hidden_size, 512);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.intermediate_size, 1408);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.rope_scaling.has_value());
}

// The start-up log's model line: head layout, dtype and RoPE included.
TEST(DemoModelTest, SummaryNamesDtypeHeadDimAndRope) {
  const ModelSpan tail = MakeDemoModel(LayerRange{2, 4}, "tail");
  EXPECT_EQ(tail.WeightDTypes(), "fp32");
  EXPECT_EQ(tail.Summary(),
            absl::StrCat("tail (llama, hidden 512, 8 heads, 4 kv heads, head_dim 64, fp32 "
                         "weights, rope theta 500000, no scaling) layers 2:4, ",
                         tail.WeightBytes(), " weight bytes"));
  // Mixed dtypes are listed in order of first appearance; none reads "no".
  ModelSpan mixed = tail;
  mixed.layers[1].q_proj.dtype = DType::kBF16;
  EXPECT_EQ(mixed.WeightDTypes(), "fp32+bf16");
  mixed.layers.clear();
  EXPECT_EQ(mixed.WeightDTypes(), "");
  EXPECT_TRUE(absl::StrContains(mixed.Summary(), "head_dim 64, no weights, rope"))
      << mixed.Summary();
}

TEST(DemoModelTest, DeterministicAndComposable) {
  const ModelSpan full = MakeDemoModel(LayerRange{});
  const ModelSpan again = MakeDemoModel(LayerRange{});
  const ModelSpan tail = MakeDemoModel(LayerRange{2, 4}, "tail");
  ASSERT_EQ(full.layers.size(), 4u);
  ASSERT_EQ(tail.layers.size(), 2u);
  EXPECT_EQ(full.name, "demo");
  EXPECT_EQ(tail.name, "tail");
  EXPECT_EQ(tail.first_layer, 2);
  for (size_t l = 0; l < 4; ++l) {
    const auto a = Tensors(full.layers[l]);
    const auto b = Tensors(again.layers[l]);
    for (size_t t = 0; t < a.size(); ++t) {
      EXPECT_EQ(a[t]->data, b[t]->data) << "layer " << l << " tensor " << t;
      if (l >= 2) {
        EXPECT_EQ(a[t]->data, Tensors(tail.layers[l - 2])[t]->data)
            << "layer " << l << " tensor " << t;
      }
    }
  }
  // Different layers and different roles draw different numbers.
  EXPECT_NE(full.layers[0].q_proj.data, full.layers[1].q_proj.data);
  EXPECT_NE(full.layers[0].gate_proj.data, full.layers[0].up_proj.data);
}

TEST(DemoModelTest, ShapesAndMagnitudes) {
  const ModelSpan span = MakeDemoModel(LayerRange{});
  const LlamaConfig& c = span.config;
  for (const LayerWeights& w : span.layers) {
    EXPECT_EQ(w.q_proj.shape, (std::vector<int64_t>{512, 512}));
    EXPECT_EQ(w.k_proj.shape, (std::vector<int64_t>{256, 512}));
    EXPECT_EQ(w.v_proj.shape, (std::vector<int64_t>{256, 512}));
    EXPECT_EQ(w.o_proj.shape, (std::vector<int64_t>{512, 512}));
    EXPECT_EQ(w.gate_proj.shape, (std::vector<int64_t>{1408, 512}));
    EXPECT_EQ(w.down_proj.shape, (std::vector<int64_t>{512, 1408}));
    EXPECT_TRUE(w.q_bias.data.empty());
    for (const HostTensor* t : Tensors(w)) {
      EXPECT_EQ(t->dtype, DType::kF32);
      EXPECT_EQ(t->data.size(), static_cast<size_t>(t->NumElements()) * 4);
    }
    for (const float v : w.input_layernorm.ToFloat()) {
      ASSERT_GE(v, 0.9f);
      ASSERT_LE(v, 1.1f);
    }
    // uniform(-1, 1) / sqrt(fan_in): bounded, mean ~0, variance 1 / (3 fan_in).
    const std::vector<float> down = w.down_proj.ToFloat();
    const double bound = 1.0 / std::sqrt(static_cast<double>(c.intermediate_size));
    double sum = 0, sum_sq = 0;
    for (const float v : down) {
      ASSERT_LE(std::abs(v), bound);
      sum += v;
      sum_sq += static_cast<double>(v) * v;
    }
    const double n = static_cast<double>(down.size());
    EXPECT_NEAR(sum / n, 0.0, 0.01 * bound);
    EXPECT_NEAR(sum_sq / n, bound * bound / 3.0, 0.02 * bound * bound);
  }
  EXPECT_EQ(span.WeightBytes(), 4u * 4u * (512 * 512 * 2 + 256 * 512 * 2 + 3 * 512 * 1408 + 1024));
}

}  // namespace
}  // namespace layerserve
