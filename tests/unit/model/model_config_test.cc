// ParseLlamaConfig on real-world-shaped configs and on broken ones, and
// RopeInvFreq against the independent float64 reference (tests/reference).
#include <cmath>
#include <numbers>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/model.h"
#include "tests/reference/llama_reference.h"

namespace layerserve {
namespace {

using ::testing::HasSubstr;

// Shaped like meta-llama/Llama-3.1-8B's config.json.
constexpr char kLlama31[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16"
})";

// Shaped like mistralai/Mistral-7B-v0.1 (sliding window, no head_dim).
constexpr char kMistral[] = R"({
  "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
  "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
  "hidden_act": "silu", "torch_dtype": "bfloat16"
})";

// Shaped like Qwen/Qwen2-0.5B.
constexpr char kQwen2[] = R"({
  "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
  "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": null,
  "sliding_window": 32768, "use_sliding_window": false, "max_window_layers": 24,
  "torch_dtype": "bfloat16"
})";

TEST(ModelConfigTest, ParsesLlama31) {
  auto c = ParseLlamaConfig(kLlama31, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->intermediate_size, 14336);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->num_hidden_layers, 32);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  ASSERT_TRUE(c->rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c->rope_scaling->factor, 8.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling->low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling->high_freq_factor, 4.0);
  EXPECT_EQ(c->rope_scaling->original_max_position_embeddings, 8192);
}

TEST(ModelConfigTest, ParsesMistralWithSlidingWindow) {
  auto c = ParseLlamaConfig(kMistral, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "mistral");
  EXPECT_EQ(c->head_dim, 128);  // hidden / heads
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_FALSE(c->rope_scaling.has_value());
  EXPECT_EQ(c->sliding_window, 4096);
  for (int64_t layer : {0, 17, 31}) EXPECT_EQ(c->AttentionWindow(layer), 4096) << layer;
  EXPECT_EQ(c->SmallestAttentionWindow(8, 4), 4096);
}

// The start-up log's words for RoPE: theta in full (no 1e+06), the scaling
// type and every factor.
TEST(ModelConfigTest, DescribeRopeNamesThetaAndScaling) {
  auto llama31 = ParseLlamaConfig(kLlama31, "config.json");
  ASSERT_TRUE(llama31.ok()) << llama31.status();
  EXPECT_EQ(DescribeRope(*llama31),
            "rope theta 500000, llama3 scaling (factor 8, low_freq_factor 1, high_freq_factor 4, "
            "original_max_position_embeddings 8192)");
  auto qwen2 = ParseLlamaConfig(kQwen2, "config.json");
  ASSERT_TRUE(qwen2.ok()) << qwen2.status();
  EXPECT_EQ(DescribeRope(*qwen2), "rope theta 1000000, no scaling");
  LlamaConfig fractional;
  fractional.rope_theta = 10000.5;
  EXPECT_EQ(DescribeRope(fractional), "rope theta 10000.5, no scaling");
}

// The sliding-window rules of the transformers configs, one case each.
TEST(ModelConfigTest, SlidingWindowFollowsTransformers) {
  const auto parse = [](const std::string& extra) {
    return ParseLlamaConfig(
        "{\"hidden_size\": 64, \"intermediate_size\": 128, \"num_attention_heads\": 4, "
        "\"num_hidden_layers\": 4, " +
            extra + "}",
        "c.json");
  };
  // Mistral: absent means MistralConfig's default of 4096; null disables it.
  auto absent = parse(R"("model_type": "mistral")");
  ASSERT_TRUE(absent.ok()) << absent.status();
  EXPECT_EQ(absent->AttentionWindow(0), 4096);
  auto null_window = parse(R"("model_type": "mistral", "sliding_window": null)");
  ASSERT_TRUE(null_window.ok()) << null_window.status();
  EXPECT_EQ(null_window->AttentionWindow(0), 0);
  EXPECT_EQ(null_window->SmallestAttentionWindow(0, 4), 0);
  // Llama has no window, whatever the file says.
  auto llama = parse(R"("model_type": "llama", "sliding_window": 16)");
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ(llama->AttentionWindow(3), 0);
  // Qwen2: only with use_sliding_window, and only from max_window_layers on.
  auto qwen_off = parse(R"("model_type": "qwen2", "sliding_window": 16)");
  ASSERT_TRUE(qwen_off.ok()) << qwen_off.status();
  EXPECT_EQ(qwen_off->AttentionWindow(3), 0);
  auto qwen_on = parse(
      R"("model_type": "qwen2", "sliding_window": 16, "use_sliding_window": true,
         "max_window_layers": 2)");
  ASSERT_TRUE(qwen_on.ok()) << qwen_on.status();
  EXPECT_EQ(qwen_on->AttentionWindow(0), 0);
  EXPECT_EQ(qwen_on->AttentionWindow(1), 0);
  EXPECT_EQ(qwen_on->AttentionWindow(2), 16);
  EXPECT_EQ(qwen_on->AttentionWindow(3), 16);
  EXPECT_EQ(qwen_on->SmallestAttentionWindow(0, 2), 0);  // a span of full layers only
  EXPECT_EQ(qwen_on->SmallestAttentionWindow(1, 2), 16);
  // An explicit layer_types list wins.
  auto typed = parse(
      R"("model_type": "mistral", "sliding_window": 8,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                         "full_attention"])");
  ASSERT_TRUE(typed.ok()) << typed.status();
  EXPECT_EQ(typed->AttentionWindow(0), 8);
  EXPECT_EQ(typed->AttentionWindow(1), 0);
  EXPECT_EQ(typed->AttentionWindow(2), 8);
  // Errors name the field.
  auto zero = parse(R"("model_type": "mistral", "sliding_window": 0)");
  ASSERT_FALSE(zero.ok());
  EXPECT_THAT(zero.status().message(), HasSubstr("sliding_window"));
  auto short_list = parse(R"("model_type": "mistral", "layer_types": ["full_attention"])");
  ASSERT_FALSE(short_list.ok());
  EXPECT_THAT(short_list.status().message(), HasSubstr("layer_types"));
  auto unknown = parse(
      R"("model_type": "mistral", "layer_types": ["full_attention", "chunked_attention",
         "full_attention", "full_attention"])");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(unknown.status().message(), HasSubstr("chunked_attention"));
}

// Shaped like mistralai/Mixtral-8x7B-v0.1's config.json.
constexpr char kMixtral[] = R"({
  "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
  "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
  "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
  "output_router_logits": false, "router_aux_loss_coef": 0.02, "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0, "sliding_window": null, "hidden_act": "silu",
  "torch_dtype": "bfloat16"
})";

TEST(ModelConfigTest, ParsesMixtralExperts) {
  auto c = ParseLlamaConfig(kMixtral, "mixtral.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->IsMixtureOfExperts());
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->experts_per_token, 2);
  EXPECT_EQ(c->intermediate_size, 14336);  // each expert's
  EXPECT_EQ(c->sliding_window, 0);

  // MixtralConfig's defaults: top 2, and no window when the field is absent
  // (MistralConfig's would be 4096).
  auto defaults = ParseLlamaConfig(R"({"model_type": "mixtral", "hidden_size": 64,
      "intermediate_size": 96, "num_attention_heads": 4, "num_hidden_layers": 2,
      "num_local_experts": 4})",
                                   "defaults.json");
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->experts_per_token, 2);
  EXPECT_EQ(defaults->sliding_window, 0);

  auto windowed = ParseLlamaConfig(R"({"model_type": "mixtral", "hidden_size": 64,
      "intermediate_size": 96, "num_attention_heads": 4, "num_hidden_layers": 2,
      "num_local_experts": 4, "num_experts_per_tok": 1, "sliding_window": 32})",
                                   "windowed.json");
  ASSERT_TRUE(windowed.ok()) << windowed.status();
  EXPECT_EQ(windowed->AttentionWindow(1), 32);

  // Mixtral renormalises its routing weights and has no shared expert.
  EXPECT_TRUE(c->normalize_top_k);
  EXPECT_FALSE(c->HasSharedExpert());

  // Dense models have no experts.
  auto llama = ParseLlamaConfig(kLlama31, "llama.json");
  ASSERT_TRUE(llama.ok());
  EXPECT_FALSE(llama->IsMixtureOfExperts());
}

TEST(ModelConfigTest, ParsesQwen2WithImpliedBias) {
  auto c = ParseLlamaConfig(kQwen2, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen2");
  EXPECT_TRUE(c->attention_bias);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->num_key_value_heads, 2);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_EQ(c->sliding_window, 0);  // use_sliding_window: false
}

TEST(ModelConfigTest, AppliesHuggingFaceDefaults) {
  auto c = ParseLlamaConfig(R"({"model_type": "llama", "hidden_size": 64,
      "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
      "num_key_value_heads": null, "head_dim": null})",
                            "tiny.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_FALSE(c->rope_scaling.has_value());
}

TEST(ModelConfigTest, ExplicitHeadDimWins) {
  auto c = ParseLlamaConfig(R"({"model_type": "mistral", "hidden_size": 5120,
      "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
      "head_dim": 128, "num_hidden_layers": 40})",
                            "nemo.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128);
}

TEST(ModelConfigTest, DefaultRopeTypeMeansNoScaling) {
  auto c = ParseLlamaConfig(R"({"model_type": "llama", "hidden_size": 64,
      "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
      "rope_scaling": {"rope_type": "default"}})",
                            "c.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->rope_scaling.has_value());
}

TEST(ModelConfigTest, RopeParametersCarryThetaAndScaling) {
  auto c = ParseLlamaConfig(R"({"model_type": "llama", "hidden_size": 64,
      "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
      "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})",
                            "c.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  ASSERT_TRUE(c->rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c->rope_scaling->factor, 32.0);
}

// Shaped like Qwen/Qwen1.5-MoE-A2.7B's config.json.
constexpr char kQwen2Moe[] = R"({
  "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
  "intermediate_size": 5632, "moe_intermediate_size": 1408,
  "shared_expert_intermediate_size": 5632, "num_attention_heads": 16,
  "num_key_value_heads": 16, "num_hidden_layers": 24, "num_experts": 60,
  "num_experts_per_tok": 4, "norm_topk_prob": false, "decoder_sparse_step": 1,
  "mlp_only_layers": [], "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "use_sliding_window": false, "sliding_window": 32768, "max_window_layers": 21,
  "hidden_act": "silu", "torch_dtype": "bfloat16"
})";

TEST(ModelConfigTest, ParsesQwen2MoeExpertsAndSharedExpert) {
  auto c = ParseLlamaConfig(kQwen2Moe, "qwen2_moe.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 60);
  EXPECT_EQ(c->experts_per_token, 4);
  EXPECT_EQ(c->intermediate_size, 1408);  // each expert's: moe_intermediate_size
  EXPECT_EQ(c->shared_expert_intermediate_size, 5632);
  EXPECT_FALSE(c->normalize_top_k);
  EXPECT_TRUE(c->attention_bias);   // qkv_bias defaults to true
  EXPECT_EQ(c->sliding_window, 0);  // use_sliding_window false

  // Qwen2MoeConfig's defaults: top 4, a shared expert of 5632, weights as
  // they are; norm_topk_prob and qkv_bias as given; a window as qwen2's.
  auto other = ParseLlamaConfig(R"({"model_type": "qwen2_moe", "hidden_size": 64,
      "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
      "num_hidden_layers": 4, "num_experts": 8, "norm_topk_prob": true, "qkv_bias": false,
      "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 2})",
                                "other.json");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->experts_per_token, 4);
  EXPECT_EQ(other->shared_expert_intermediate_size, 5632);
  EXPECT_TRUE(other->normalize_top_k);
  EXPECT_FALSE(other->attention_bias);
  EXPECT_EQ(other->AttentionWindow(1), 0);
  EXPECT_EQ(other->AttentionWindow(2), 16);

  // A shared expert of 0: none.
  auto unshared = ParseLlamaConfig(R"({"model_type": "qwen2_moe", "hidden_size": 64,
      "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
      "num_hidden_layers": 2, "num_experts": 8, "shared_expert_intermediate_size": 0})",
                                   "unshared.json");
  ASSERT_TRUE(unshared.ok()) << unshared.status();
  EXPECT_FALSE(unshared->HasSharedExpert());
}

// Shaped like Qwen/Qwen3-30B-A3B's config.json (and, without its experts,
// a dense Qwen3's).
constexpr char kQwen3Moe[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
  "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
  "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48, "num_experts": 128,
  "num_experts_per_tok": 8, "norm_topk_prob": true, "decoder_sparse_step": 1,
  "mlp_only_layers": [], "attention_bias": false, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "use_sliding_window": false, "sliding_window": null,
  "max_window_layers": 48, "hidden_act": "silu", "torch_dtype": "bfloat16"
})";

TEST(ModelConfigTest, ParsesQwen3HeadNormsAndExperts) {
  auto moe = ParseLlamaConfig(kQwen3Moe, "qwen3_moe.json");
  ASSERT_TRUE(moe.ok()) << moe.status();
  EXPECT_TRUE(moe->qk_norm);
  EXPECT_FALSE(moe->attention_bias);
  EXPECT_EQ(moe->head_dim, 128);  // not hidden / heads (64)
  EXPECT_EQ(moe->num_experts, 128);
  EXPECT_EQ(moe->experts_per_token, 8);
  EXPECT_EQ(moe->intermediate_size, 768);
  EXPECT_TRUE(moe->normalize_top_k);
  EXPECT_FALSE(moe->HasSharedExpert());

  auto dense = ParseLlamaConfig(R"({"model_type": "qwen3", "hidden_size": 64,
      "intermediate_size": 96, "num_attention_heads": 4, "num_hidden_layers": 2,
      "head_dim": 32})",
                                "qwen3.json");
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_TRUE(dense->qk_norm);
  EXPECT_FALSE(dense->IsMixtureOfExperts());
  EXPECT_FALSE(dense->attention_bias);

  // Qwen3MoeConfig's defaults: 8 experts per token, weights as they are.
  auto defaults = ParseLlamaConfig(R"({"model_type": "qwen3_moe", "hidden_size": 64,
      "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
      "num_hidden_layers": 2, "num_experts": 16})",
                                   "defaults.json");
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->experts_per_token, 8);
  EXPECT_FALSE(defaults->normalize_top_k);

  // transformers 5's save_pretrained writes the count as num_local_experts.
  auto saved = ParseLlamaConfig(R"({"model_type": "qwen3_moe", "hidden_size": 64,
      "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
      "num_hidden_layers": 2, "num_local_experts": 12, "num_experts_per_tok": 2})",
                                "saved.json");
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->num_experts, 12);

  // Qwen3Attention's attention_bias also biases o_proj, which has no slot.
  auto biased = ParseLlamaConfig(R"({"model_type": "qwen3", "hidden_size": 64,
      "intermediate_size": 96, "num_attention_heads": 4, "num_hidden_layers": 2,
      "attention_bias": true})",
                                 "biased.json");
  EXPECT_EQ(biased.status().code(), absl::StatusCode::kUnimplemented);
}

struct BadConfig {
  std::string label;
  std::string json;
  absl::StatusCode code;
  std::string fragment;
};

TEST(ModelConfigTest, RejectsBadConfigs) {
  const std::string base = R"("hidden_size": 64, "intermediate_size": 128,
      "num_attention_heads": 4, "num_hidden_layers": 2)";
  const std::vector<BadConfig> cases = {
      {"not JSON", "{\"model_type\": ", absl::StatusCode::kInvalidArgument, "not valid JSON"},
      {"not an object", "[]", absl::StatusCode::kInvalidArgument, "not a JSON object"},
      {"missing model_type", "{" + base + "}", absl::StatusCode::kInvalidArgument,
       "'model_type' is missing"},
      {"unsupported model_type", R"({"model_type": "gpt2", )" + base + "}",
       absl::StatusCode::kInvalidArgument, "'gpt2' is not supported"},
      {"mixtral without experts", R"({"model_type": "mixtral", )" + base + "}",
       absl::StatusCode::kInvalidArgument, "'num_local_experts' is missing"},
      {"more experts per token than experts",
       R"({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 5, )" + base +
           "}",
       absl::StatusCode::kInvalidArgument, "between 1 and num_local_experts (4)"},
      {"qwen2_moe without experts", R"({"model_type": "qwen2_moe", )" + base + "}",
       absl::StatusCode::kInvalidArgument, "'num_experts' is missing"},
      {"qwen2_moe without the experts' size",
       R"({"model_type": "qwen2_moe", "num_experts": 4, )" + base + "}",
       absl::StatusCode::kInvalidArgument, "'moe_intermediate_size' is missing"},
      {"qwen2_moe with dense layers",
       R"({"model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": 32,
           "decoder_sparse_step": 2, )" +
           base + "}",
       absl::StatusCode::kUnimplemented, "(2) and mlp_only_layers ([]) give some layers a dense"},
      {"qwen2_moe with mlp-only layers",
       R"({"model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": 32,
           "mlp_only_layers": [1], )" +
           base + "}",
       absl::StatusCode::kUnimplemented, "(1) and mlp_only_layers ([1])"},
      {"qwen2_moe with fewer experts than its default 4 per token",
       R"({"model_type": "qwen2_moe", "num_experts": 3, "moe_intermediate_size": 32, )" + base +
           "}",
       absl::StatusCode::kInvalidArgument, "(4) must be between 1 and num_experts (3)"},
      {"missing hidden_size",
       R"({"model_type": "llama", "intermediate_size": 128, "num_attention_heads": 4,
           "num_hidden_layers": 2})",
       absl::StatusCode::kInvalidArgument, "'hidden_size' is missing"},
      {"string hidden_size",
       R"({"model_type": "llama", "hidden_size": "64", "intermediate_size": 128,
           "num_attention_heads": 4, "num_hidden_layers": 2})",
       absl::StatusCode::kInvalidArgument, "'hidden_size' must be an integer"},
      {"float layers",
       R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_hidden_layers": 2.5})",
       absl::StatusCode::kInvalidArgument, "'num_hidden_layers' must be an integer"},
      {"zero heads",
       R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 0, "num_hidden_layers": 2})",
       absl::StatusCode::kInvalidArgument, "'num_attention_heads' must be positive"},
      {"kv heads do not divide",
       R"({"model_type": "llama", "num_key_value_heads": 3, )" + base + "}",
       absl::StatusCode::kInvalidArgument, "num_key_value_heads"},
      {"hidden not divisible",
       R"({"model_type": "llama", "hidden_size": 66, "intermediate_size": 128,
           "num_attention_heads": 4, "num_hidden_layers": 2})",
       absl::StatusCode::kInvalidArgument, "not divisible"},
      {"odd head_dim", R"({"model_type": "llama", "head_dim": 15, )" + base + "}",
       absl::StatusCode::kInvalidArgument, "'head_dim'"},
      {"string rope_theta", R"({"model_type": "llama", "rope_theta": "1e4", )" + base + "}",
       absl::StatusCode::kInvalidArgument, "'rope_theta' must be a number"},
      {"string attention_bias", R"({"model_type": "llama", "attention_bias": "yes", )" + base + "}",
       absl::StatusCode::kInvalidArgument, "'attention_bias' must be true or false"},
      {"rope_scaling not object", R"({"model_type": "llama", "rope_scaling": 8, )" + base + "}",
       absl::StatusCode::kInvalidArgument, "'rope_scaling' must be an object"},
      {"yarn rope", R"({"model_type": "qwen2", "rope_scaling": {"type": "yarn", "factor": 4},
           )" + base + "}",
       absl::StatusCode::kUnimplemented, "'yarn' is not supported"},
      {"linear rope",
       R"({"model_type": "llama", "rope_scaling": {"rope_type": "linear",
           "factor": 2}, )" +
           base + "}",
       absl::StatusCode::kUnimplemented, "'linear' is not supported"},
      {"llama3 missing factor",
       R"({"model_type": "llama", "rope_scaling": {"rope_type": "llama3",
           "low_freq_factor": 1, "high_freq_factor": 4,
           "original_max_position_embeddings": 8192}, )" +
           base + "}",
       absl::StatusCode::kInvalidArgument, "'rope_scaling.factor' is missing"},
      {"llama3 equal bands",
       R"({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8,
           "low_freq_factor": 2, "high_freq_factor": 2,
           "original_max_position_embeddings": 8192}, )" +
           base + "}",
       absl::StatusCode::kInvalidArgument, "high_freq_factor"},
      {"llama o_proj bias", R"({"model_type": "llama", "attention_bias": true, )" + base + "}",
       absl::StatusCode::kUnimplemented, "attention_bias=true"},
      {"mlp bias", R"({"model_type": "llama", "mlp_bias": true, )" + base + "}",
       absl::StatusCode::kUnimplemented, "mlp_bias"},
      {"gelu", R"({"model_type": "llama", "hidden_act": "gelu", )" + base + "}",
       absl::StatusCode::kUnimplemented, "'gelu'"},
  };
  for (const BadConfig& c : cases) {
    SCOPED_TRACE(c.label);
    auto parsed = ParseLlamaConfig(c.json, "/models/x/config.json");
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), c.code) << parsed.status();
    EXPECT_THAT(parsed.status().message(), HasSubstr("/models/x/config.json"));
    EXPECT_THAT(parsed.status().message(), HasSubstr(c.fragment));
  }
}

reference::Config ReferenceRope(const LlamaConfig& c) {
  reference::Config r;
  r.head_dim = c.head_dim;
  r.rope_theta = c.rope_theta;
  if (c.rope_scaling) {
    r.llama3 = true;
    r.llama3_factor = c.rope_scaling->factor;
    r.llama3_low_freq_factor = c.rope_scaling->low_freq_factor;
    r.llama3_high_freq_factor = c.rope_scaling->high_freq_factor;
    r.llama3_original_max_positions =
        static_cast<double>(c.rope_scaling->original_max_position_embeddings);
  }
  return r;
}

void ExpectInvFreqMatchesReference(const LlamaConfig& c) {
  const std::vector<float> got = RopeInvFreq(c);
  const std::vector<double> want = reference::RopeInvFreq(ReferenceRope(c));
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double rel = std::abs(got[i] - want[i]) / want[i];
    if (!(rel <= worst)) {
      worst = rel;
      worst_i = i;
    }
  }
  // float32 pow plus a few float32 ops: a handful of ulps.
  EXPECT_LT(worst, 2e-6) << "worst element " << worst_i << ": got " << got[worst_i]
                         << ", reference " << want[worst_i];
}

TEST(RopeInvFreqTest, DefaultMatchesReference) {
  LlamaConfig c;
  c.head_dim = 128;
  c.rope_theta = 10000.0;
  ExpectInvFreqMatchesReference(c);
  c.head_dim = 64;
  c.rope_theta = 1e6;
  ExpectInvFreqMatchesReference(c);
}

TEST(RopeInvFreqTest, Llama3ScalingMatchesReference) {
  auto c = ParseLlamaConfig(kLlama31, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectInvFreqMatchesReference(*c);

  // Spot checks of the three bands, computed here from the definition.
  const std::vector<float> f = RopeInvFreq(*c);
  ASSERT_EQ(f.size(), 64u);
  // Highest frequency: wavelength 2*pi < 8192/4, unchanged.
  EXPECT_FLOAT_EQ(f[0], 1.0f);
  // Lowest frequency: wavelength far beyond 8192, divided by the factor 8.
  const double lowest = std::pow(500000.0, -126.0 / 128.0) / 8.0;
  EXPECT_NEAR(f[63], lowest, lowest * 1e-6);
  // i = 30: wavelength 2*pi*500000^(60/128) ~ 2882, inside [2048, 8192]:
  // interpolated with smooth = (8192/wavelength - 1) / 3.
  const double base = std::pow(500000.0, -60.0 / 128.0);
  const double smooth = (8192.0 / (2 * std::numbers::pi / base) - 1.0) / 3.0;
  ASSERT_GT(smooth, 0.0);
  ASSERT_LT(smooth, 1.0);
  const double medium = (1 - smooth) * base / 8.0 + smooth * base;
  EXPECT_NEAR(f[30], medium, medium * 1e-6);
}

}  // namespace
}  // namespace layerserve
