// LoadModelSpan on tiny mixtral and qwen2_moe checkpoints: the published
// per-expert layouts and transformers 5's fused one load into the same
// stacked tensors, and each way an expert can be missing or mismatched is one
// clear error.
#include <array>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/model.h"
#include "tests/unit/model/test_files.h"

namespace layerserve {
namespace {

using ::testing::HasSubstr;
using testing_files::F32Bytes;
using testing_files::SafetensorsBytes;
using testing_files::ScratchDir;
using testing_files::TensorSpec;
using testing_files::WriteFile;

// hidden 8, expert intermediate 4, 2 heads of 4, 1 KV head, 2 layers, 3
// experts of which each token uses 2.
constexpr int64_t kHidden = 8;
constexpr int64_t kInter = 4;
constexpr int64_t kExperts = 3;
constexpr char kConfig[] = R"({"model_type": "mixtral", "hidden_size": 8,
    "intermediate_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
    "num_hidden_layers": 2, "num_local_experts": 3, "num_experts_per_tok": 2,
    "sliding_window": null, "torch_dtype": "float32"})";

// Element i of expert e's `part` (0: w1, 1: w3, 2: w2, 3: the router's row
// e) in layer `layer`: distinct everywhere, exact in float32.
float Value(int64_t layer, int64_t e, int part, int64_t i) {
  return static_cast<float>(((layer * 4 + part) * 16 + e) * 64 + i);
}

std::vector<float> Values(int64_t layer, int64_t e, int part, int64_t count) {
  std::vector<float> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) v[static_cast<size_t>(i)] = Value(layer, e, part, i);
  return v;
}

std::string Name(int64_t layer, const std::string& module) {
  return "model.layers." + std::to_string(layer) + "." + module;
}

// The attention half of a layer, which both layouts share.
std::vector<TensorSpec> AttentionTensors(int64_t layer) {
  const auto t = [&](const std::string& module, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return TensorSpec{Name(layer, module), "F32", shape,
                      F32Bytes(std::vector<float>(static_cast<size_t>(n), 0.5f))};
  };
  return {t("input_layernorm.weight", {8}),     t("self_attn.q_proj.weight", {8, 8}),
          t("self_attn.k_proj.weight", {4, 8}), t("self_attn.v_proj.weight", {4, 8}),
          t("self_attn.o_proj.weight", {8, 8}), t("post_attention_layernorm.weight", {8})};
}

std::vector<float> RouterValues(int64_t layer) {
  std::vector<float> v;
  for (int64_t e = 0; e < kExperts; ++e) {
    const std::vector<float> row = Values(layer, e, 3, kHidden);
    v.insert(v.end(), row.begin(), row.end());
  }
  return v;
}

// One tensor per expert and part, as published checkpoints store them: the
// router `router`, and `experts`{e}.`parts` (gate, up, down) for each e.
std::vector<TensorSpec> PerExpertCheckpoint(const std::string& router, const std::string& experts,
                                            const std::array<std::string, 3>& parts) {
  const std::vector<int64_t> shapes[3] = {{kInter, kHidden}, {kInter, kHidden}, {kHidden, kInter}};
  std::vector<TensorSpec> out;
  for (int64_t layer = 0; layer < 2; ++layer) {
    for (TensorSpec& t : AttentionTensors(layer)) out.push_back(std::move(t));
    out.push_back({Name(layer, router), "F32", {kExperts, kHidden}, F32Bytes(RouterValues(layer))});
    for (int64_t e = 0; e < kExperts; ++e) {
      for (int part = 0; part < 3; ++part) {
        out.push_back({Name(layer, experts + std::to_string(e) + "." + parts[part]), "F32",
                       shapes[part], F32Bytes(Values(layer, e, part, kInter * kHidden))});
      }
    }
  }
  return out;
}

// block_sparse_moe.gate.weight and experts.{e}.w1/w2/w3.weight.
std::vector<TensorSpec> PublishedCheckpoint() {
  return PerExpertCheckpoint("block_sparse_moe.gate.weight", "block_sparse_moe.experts.",
                             {"w1.weight", "w3.weight", "w2.weight"});
}

// What the loader must build: per expert its w1 rows then its w3 rows, and
// the w2s one after the other.
std::vector<float> ExpectedGateUp(int64_t layer) {
  std::vector<float> v;
  for (int64_t e = 0; e < kExperts; ++e) {
    for (int part : {0, 1}) {
      const std::vector<float> rows = Values(layer, e, part, kInter * kHidden);
      v.insert(v.end(), rows.begin(), rows.end());
    }
  }
  return v;
}

std::vector<float> ExpectedDown(int64_t layer) {
  std::vector<float> v;
  for (int64_t e = 0; e < kExperts; ++e) {
    const std::vector<float> rows = Values(layer, e, 2, kHidden * kInter);
    v.insert(v.end(), rows.begin(), rows.end());
  }
  return v;
}

// mlp.gate.weight, mlp.experts.gate_up_proj and mlp.experts.down_proj, as
// transformers 5 names Mixtral's tensors (the expert ones without ".weight").
std::vector<TensorSpec> FusedCheckpoint() {
  std::vector<TensorSpec> out;
  for (int64_t layer = 0; layer < 2; ++layer) {
    for (TensorSpec& t : AttentionTensors(layer)) out.push_back(std::move(t));
    out.push_back({Name(layer, "mlp.gate.weight"),
                   "F32",
                   {kExperts, kHidden},
                   F32Bytes(RouterValues(layer))});
    out.push_back({Name(layer, "mlp.experts.gate_up_proj"),
                   "F32",
                   {kExperts, 2 * kInter, kHidden},
                   F32Bytes(ExpectedGateUp(layer))});
    out.push_back({Name(layer, "mlp.experts.down_proj"),
                   "F32",
                   {kExperts, kHidden, kInter},
                   F32Bytes(ExpectedDown(layer))});
  }
  return out;
}

absl::StatusOr<ModelSpan> Load(const std::vector<TensorSpec>& tensors, const ScratchDir& dir,
                               const char* config = kConfig) {
  WriteFile(dir.path() / "config.json", config);
  WriteFile(dir.path() / "model.safetensors", SafetensorsBytes(tensors));
  return LoadModelSpan(dir.path(), LayerRange{}, "tiny-mixtral");
}

void ExpectStackedExperts(const ModelSpan& span) {
  ASSERT_EQ(span.layers.size(), 2u);
  for (int64_t layer = 0; layer < 2; ++layer) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    const LayerWeights& w = span.layers[static_cast<size_t>(layer)];
    EXPECT_EQ(w.router.shape, (std::vector<int64_t>{kExperts, kHidden}));
    EXPECT_EQ(w.experts_gate_up.shape, (std::vector<int64_t>{kExperts, 2 * kInter, kHidden}));
    EXPECT_EQ(w.experts_down.shape, (std::vector<int64_t>{kExperts, kHidden, kInter}));
    EXPECT_EQ(w.router.ToFloat(), RouterValues(layer));
    EXPECT_EQ(w.experts_gate_up.ToFloat(), ExpectedGateUp(layer));
    EXPECT_EQ(w.experts_down.ToFloat(), ExpectedDown(layer));
    EXPECT_EQ(w.gate_proj.NumElements(), 0);  // no dense MLP
    EXPECT_TRUE(CheckLayerWeights(w, span.config, layer).ok());
  }
}

TEST(MoeLoaderTest, PublishedLayoutStacksTheExperts) {
  ScratchDir dir;
  auto span = Load(PublishedCheckpoint(), dir);
  ASSERT_TRUE(span.ok()) << span.status();
  ExpectStackedExperts(*span);
  EXPECT_THAT(span->Summary(), HasSubstr("(mixtral, hidden 8, 2 heads, 1 kv heads, head_dim 4, "
                                         "3 experts, top 2, fp32 weights"));
  // Per layer: 8+64+32+32+64+8 attention and norms, 24 router, 3 experts of
  // 3 x 32 floats.
  EXPECT_EQ(span->WeightBytes(), 2u * (208u + 24u + 288u) * 4u);
}

TEST(MoeLoaderTest, TransformersFiveLayoutLoadsTheSame) {
  ScratchDir dir;
  auto span = Load(FusedCheckpoint(), dir);
  ASSERT_TRUE(span.ok()) << span.status();
  ExpectStackedExperts(*span);
}

TEST(MoeLoaderTest, MissingExpertIsNamed) {
  ScratchDir dir;
  std::vector<TensorSpec> tensors = PublishedCheckpoint();
  std::erase_if(tensors, [](const TensorSpec& t) {
    return t.name == "model.layers.1.block_sparse_moe.experts.2.w2.weight";
  });
  auto span = Load(tensors, dir);
  ASSERT_FALSE(span.ok());
  EXPECT_EQ(span.status().code(), absl::StatusCode::kNotFound) << span.status();
  EXPECT_THAT(span.status().message(),
              HasSubstr("'model.layers.1.block_sparse_moe.experts.2.w2.weight' is missing"));
}

TEST(MoeLoaderTest, DenseCheckpointUnderAMixtralConfigNamesTheRouter) {
  ScratchDir dir;
  std::vector<TensorSpec> tensors = AttentionTensors(0);
  for (TensorSpec& t : AttentionTensors(1)) tensors.push_back(std::move(t));
  auto span = Load(tensors, dir);
  ASSERT_FALSE(span.ok());
  EXPECT_THAT(span.status().message(),
              HasSubstr("'model.layers.0.block_sparse_moe.gate.weight' is missing"));
}

TEST(MoeLoaderTest, ExpertShapeAndDTypeMismatchesAreNamed) {
  {
    ScratchDir dir;
    std::vector<TensorSpec> tensors = PublishedCheckpoint();
    for (TensorSpec& t : tensors) {
      if (t.name == "model.layers.0.block_sparse_moe.experts.1.w3.weight")
        t.shape = {kHidden, kInter};
    }
    auto span = Load(tensors, dir);
    ASSERT_FALSE(span.ok());
    EXPECT_THAT(span.status().message(),
                HasSubstr("'model.layers.0.block_sparse_moe.experts.1.w3.weight' has shape [8, 4], "
                          "expected [4, 8]"));
  }
  {
    ScratchDir dir;
    std::vector<TensorSpec> tensors = PublishedCheckpoint();
    for (TensorSpec& t : tensors) {
      if (t.name != "model.layers.0.block_sparse_moe.experts.2.w1.weight") continue;
      // The same values in BF16: the upper halves of the float32 words.
      std::vector<unsigned char> bf16;
      for (size_t i = 0; i < t.bytes.size(); i += 4) {
        bf16.push_back(t.bytes[i + 2]);
        bf16.push_back(t.bytes[i + 3]);
      }
      t.dtype = "BF16";
      t.bytes = bf16;
    }
    auto span = Load(tensors, dir);
    ASSERT_FALSE(span.ok());
    EXPECT_THAT(span.status().message(),
                HasSubstr("'model.layers.0.block_sparse_moe.experts.2.w1.weight' is BF16 but the "
                          "experts before it are FP32"));
  }
}

// ---- qwen2_moe ----------------------------------------------------------

// The same experts under Qwen2-MoE's names, weights used as they are (its
// default), and a shared expert of intermediate 6; no q/k/v biases, so the
// attention tensors above serve.
constexpr int64_t kShared = 6;
constexpr char kQwen2MoeConfig[] = R"({"model_type": "qwen2_moe", "hidden_size": 8,
    "intermediate_size": 32, "moe_intermediate_size": 4, "num_attention_heads": 2,
    "num_key_value_heads": 1, "num_hidden_layers": 2, "num_experts": 3,
    "num_experts_per_tok": 2, "shared_expert_intermediate_size": 6, "qkv_bias": false,
    "torch_dtype": "float32"})";

// The shared expert's tensors of `layer`: gate, up, down, then its gate.
std::vector<TensorSpec> SharedExpert(int64_t layer) {
  return {{Name(layer, "mlp.shared_expert.gate_proj.weight"),
           "F32",
           {kShared, kHidden},
           F32Bytes(Values(layer, 10, 0, kShared * kHidden))},
          {Name(layer, "mlp.shared_expert.up_proj.weight"),
           "F32",
           {kShared, kHidden},
           F32Bytes(Values(layer, 10, 1, kShared * kHidden))},
          {Name(layer, "mlp.shared_expert.down_proj.weight"),
           "F32",
           {kHidden, kShared},
           F32Bytes(Values(layer, 10, 2, kHidden * kShared))},
          {Name(layer, "mlp.shared_expert_gate.weight"),
           "F32",
           {1, kHidden},
           F32Bytes(Values(layer, 10, 3, kHidden))}};
}

// mlp.gate.weight and mlp.experts.{e}.gate_proj/up_proj/down_proj.weight, as
// the published Qwen checkpoints store them; or, with `fused`, the experts
// as transformers 5 holds them.
std::vector<TensorSpec> Qwen2MoeCheckpoint(bool fused) {
  if (fused) {
    std::vector<TensorSpec> out = FusedCheckpoint();
    for (int64_t layer = 0; layer < 2; ++layer) {
      for (TensorSpec& t : SharedExpert(layer)) out.push_back(std::move(t));
    }
    return out;
  }
  std::vector<TensorSpec> out =
      PerExpertCheckpoint("mlp.gate.weight", "mlp.experts.",
                          {"gate_proj.weight", "up_proj.weight", "down_proj.weight"});
  for (int64_t layer = 0; layer < 2; ++layer) {
    for (TensorSpec& t : SharedExpert(layer)) out.push_back(std::move(t));
  }
  return out;
}

TEST(MoeLoaderTest, Qwen2MoeLoadsItsExpertsAndSharedExpertInEitherLayout) {
  for (const bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "transformers 5 layout" : "published layout");
    ScratchDir dir;
    auto span = Load(Qwen2MoeCheckpoint(fused), dir, kQwen2MoeConfig);
    ASSERT_TRUE(span.ok()) << span.status();
    ExpectStackedExperts(*span);
    const LlamaConfig& c = span->config;
    EXPECT_EQ(c.intermediate_size, kInter);  // moe_intermediate_size
    EXPECT_EQ(c.shared_expert_intermediate_size, kShared);
    EXPECT_FALSE(c.normalize_top_k);
    for (int64_t layer = 0; layer < 2; ++layer) {
      const LayerWeights& w = span->layers[static_cast<size_t>(layer)];
      EXPECT_EQ(w.shared_gate_proj.ToFloat(), Values(layer, 10, 0, kShared * kHidden));
      EXPECT_EQ(w.shared_up_proj.ToFloat(), Values(layer, 10, 1, kShared * kHidden));
      EXPECT_EQ(w.shared_down_proj.ToFloat(), Values(layer, 10, 2, kHidden * kShared));
      EXPECT_EQ(w.shared_expert_gate.shape, (std::vector<int64_t>{1, kHidden}));
      EXPECT_EQ(w.shared_expert_gate.ToFloat(), Values(layer, 10, 3, kHidden));
    }
    EXPECT_THAT(span->Summary(), HasSubstr("3 experts, top 2, shared expert 6, fp32 weights"));
  }
}

TEST(MoeLoaderTest, Qwen2MoeMissingSharedExpertGateIsNamed) {
  ScratchDir dir;
  std::vector<TensorSpec> tensors = Qwen2MoeCheckpoint(/*fused=*/false);
  std::erase_if(tensors, [](const TensorSpec& t) {
    return t.name == "model.layers.1.mlp.shared_expert_gate.weight";
  });
  auto span = Load(tensors, dir, kQwen2MoeConfig);
  ASSERT_FALSE(span.ok());
  EXPECT_THAT(span.status().message(),
              HasSubstr("'model.layers.1.mlp.shared_expert_gate.weight' is missing"));
}

// A layer's MLP holds the shared expert only when the config names one.
TEST(MoeLoaderTest, SharedExpertTensorsAreCheckedAgainstTheConfig) {
  ScratchDir dir;
  auto span = Load(Qwen2MoeCheckpoint(/*fused=*/false), dir, kQwen2MoeConfig);
  ASSERT_TRUE(span.ok()) << span.status();
  LlamaConfig without = span->config;
  without.shared_expert_intermediate_size = 0;
  const absl::Status status = CheckLayerWeights(span->layers[0], without, 0);
  EXPECT_THAT(status.message(), HasSubstr("shared_gate_proj")) << status;
}

}  // namespace
}  // namespace layerserve
