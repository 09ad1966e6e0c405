// FP8 checkpoints: quantization_config parsed into Fp8Quantization (both
// formats, each scheme the server computes, and a one-line refusal for every
// one it does not), and FP8 weights loaded with their scales as each format
// names and lays them out, from checkpoints written here.
#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/model/model.h"
#include "tests/unit/model/test_files.h"

namespace layerserve {
namespace {

using ::testing::HasSubstr;
using testing_files::SafetensorsBytes;
using testing_files::ScratchDir;
using testing_files::TensorSpec;
using testing_files::WriteFile;
using Activations = Fp8Quantization::Activations;

// hidden 8, intermediate 12, 2 heads of 4, 1 KV head, 1 layer, with
// `quantization` as its quantization_config.
std::string Config(const nlohmann::json& quantization) {
  nlohmann::json c = {{"model_type", "llama"},    {"hidden_size", 8},
                      {"intermediate_size", 12},  {"num_attention_heads", 2},
                      {"num_key_value_heads", 1}, {"num_hidden_layers", 1},
                      {"rms_norm_eps", 1e-5}};
  c["quantization_config"] = quantization;
  return c.dump();
}

absl::StatusOr<Fp8Quantization> Parse(const nlohmann::json& quantization) {
  absl::StatusOr<LlamaConfig> c = ParseLlamaConfig(Config(quantization), "config.json");
  if (!c.ok()) return c.status();
  if (!c->fp8) return absl::NotFoundError("no fp8");
  return *c->fp8;
}

nlohmann::json FineGrained() {
  // As transformers 5.17 saves FineGrainedFP8Config.
  return {{"quant_method", "fp8"},
          {"activation_scheme", "dynamic"},
          {"weight_block_size", {128, 128}},
          {"modules_to_not_convert", nullptr},
          {"dequantize", false},
          {"scale_fmt", "float"}};
}

nlohmann::json CompressedTensors(const std::string& weights, const nlohmann::json& inputs) {
  nlohmann::json w = {{"num_bits", 8},
                      {"type", "float"},
                      {"strategy", weights},
                      {"symmetric", true},
                      {"dynamic", false}};
  if (weights == "block") w["block_structure"] = {128, 128};
  return {{"quant_method", "compressed-tensors"},
          {"format", "float-quantized"},
          {"config_groups",
           {{"group_0", {{"targets", {"Linear"}}, {"weights", w}, {"input_activations", inputs}}}}},
          {"ignore", {"lm_head"}},
          {"kv_cache_scheme", nullptr},
          {"quantization_status", "compressed"}};
}

nlohmann::json Inputs(const std::string& strategy, bool dynamic) {
  nlohmann::json a = {{"num_bits", 8},
                      {"type", "float"},
                      {"strategy", strategy},
                      {"symmetric", true},
                      {"dynamic", dynamic}};
  if (strategy == "group") a["group_size"] = 128;
  return a;
}

TEST(Fp8ConfigTest, ParsesEachFormatsSchemes) {
  absl::StatusOr<Fp8Quantization> q = Parse(FineGrained());
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->format, Fp8Quantization::Format::kFineGrained);
  EXPECT_EQ(q->activations, Activations::kPerTokenGroup);
  EXPECT_EQ(q->activation_group, 128);
  EXPECT_EQ(q->weight_block_rows, 128);
  EXPECT_EQ(q->weight_block_cols, 128);
  EXPECT_EQ(q->Describe(),
            "fp8 (transformers fine-grained: 128x128 weight blocks, activations per token and "
            "128 channels, dynamic)");

  q = Parse(CompressedTensors("channel", Inputs("token", true)));  // FP8_DYNAMIC
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->format, Fp8Quantization::Format::kCompressedTensors);
  EXPECT_EQ(q->activations, Activations::kPerToken);
  EXPECT_EQ(q->weight_block_rows, 1);
  EXPECT_EQ(q->weight_block_cols, 0);

  q = Parse(CompressedTensors("tensor", Inputs("tensor", false)));  // FP8 (static)
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->activations, Activations::kStaticPerTensor);
  EXPECT_EQ(q->weight_block_rows, 0);
  EXPECT_EQ(q->weight_block_cols, 0);

  q = Parse(CompressedTensors("block", Inputs("group", true)));  // FP8_BLOCK
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->activations, Activations::kPerTokenGroup);
  EXPECT_EQ(q->activation_group, 128);
  EXPECT_EQ(q->weight_block_rows, 128);

  q = Parse(CompressedTensors("channel", nullptr));  // weight-only
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->activations, Activations::kNone);

  absl::StatusOr<LlamaConfig> none = ParseLlamaConfig(Config(nullptr), "config.json");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->fp8.has_value());
}

// What the server would compute otherwise than the format says is refused at
// load, in one line naming the field.
TEST(Fp8ConfigTest, RefusesWhatItDoesNotComputeExactly) {
  struct Case {
    nlohmann::json quantization;
    std::vector<std::string> words;
  };
  std::vector<Case> cases;
  cases.push_back({{{"quant_method", "gptq"}, {"bits", 4}}, {"quant_method", "'gptq'"}});
  nlohmann::json q = FineGrained();
  q["activation_scheme"] = "static";
  cases.push_back({q, {"activation_scheme", "'static'"}});
  q = FineGrained();
  q["scale_fmt"] = "ue8m0";
  cases.push_back({q, {"scale_fmt", "'ue8m0'"}});
  q = FineGrained();
  q.erase("weight_block_size");
  cases.push_back({q, {"weight_block_size", "per-tensor"}});
  q = FineGrained();
  q["weight_block_size"] = {128};
  cases.push_back({q, {"weight_block_size", "pair"}});
  q = FineGrained();
  q["dequantize"] = true;
  cases.push_back({q, {"dequantize"}});
  q = CompressedTensors("channel", Inputs("token", true));
  q["format"] = "pack-quantized";
  cases.push_back({q, {"format", "'pack-quantized'"}});
  q = CompressedTensors("channel", Inputs("token", true));
  q["config_groups"]["group_0"]["weights"]["type"] = "int";
  cases.push_back({q, {"weights", "int", "8-bit float"}});
  q = CompressedTensors("channel", Inputs("token", true));
  q["config_groups"]["group_1"] = q["config_groups"]["group_0"];
  cases.push_back({q, {"config_groups", "exactly one group"}});
  q = CompressedTensors("channel", Inputs("token", true));
  q["kv_cache_scheme"] = {{"num_bits", 8}};
  cases.push_back({q, {"kv_cache_scheme"}});
  cases.push_back(
      {CompressedTensors("channel", Inputs("token", false)), {"input_activations", "'token'"}});
  cases.push_back({CompressedTensors("group", Inputs("token", true)), {"strategy", "'group'"}});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.quantization.dump());
    absl::StatusOr<Fp8Quantization> parsed = Parse(c.quantization);
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("config.json"));
    for (const std::string& word : c.words) {
      EXPECT_THAT(std::string(parsed.status().message()), HasSubstr(word));
    }
    EXPECT_EQ(std::string(parsed.status().message()).find('\n'), std::string::npos);
  }
}

// ---- loading ----------------------------------------------------------------

std::vector<unsigned char> Fp8Bytes(int64_t n, int salt) {
  std::vector<unsigned char> bytes(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    bytes[i] = FloatToFp8E4M3(static_cast<float>((i * 7 + salt) % 29 - 14) * 0.375f);
  }
  return bytes;
}

std::vector<unsigned char> ScaleBytes(const std::vector<float>& scales, const std::string& dtype) {
  std::vector<unsigned char> bytes(scales.size() *
                                   DTypeSize(dtype == "BF16" ? DType::kBF16 : DType::kF32));
  ConvertFromFloat(scales.data(), scales.size(), dtype == "BF16" ? DType::kBF16 : DType::kF32,
                   bytes.data());
  return bytes;
}

struct Projection {
  std::string module;
  int64_t rows, cols;
};
const std::vector<Projection> kProjections = {
    {"self_attn.q_proj", 8, 8}, {"self_attn.k_proj", 4, 8}, {"self_attn.v_proj", 4, 8},
    {"self_attn.o_proj", 8, 8}, {"mlp.gate_proj", 12, 8},   {"mlp.up_proj", 12, 8},
    {"mlp.down_proj", 8, 12}};

std::string Name(const std::string& module) { return "model.layers.0." + module; }

// A one-layer checkpoint whose projections are FP8 with scales laid out by
// `scales` (module, rows, cols -> the scale tensors to write).
std::vector<TensorSpec> Layer(
    const std::function<std::vector<TensorSpec>(const Projection&, int)>& scales) {
  std::vector<TensorSpec> t;
  const std::vector<float> ones(8, 1.0f);
  t.push_back({Name("input_layernorm.weight"), "F32", {8}, testing_files::F32Bytes(ones)});
  t.push_back({Name("post_attention_layernorm.weight"), "F32", {8}, testing_files::F32Bytes(ones)});
  int salt = 0;
  for (const Projection& p : kProjections) {
    t.push_back({Name(p.module + ".weight"),
                 "F8_E4M3",
                 {p.rows, p.cols},
                 Fp8Bytes(p.rows * p.cols, ++salt)});
    for (TensorSpec& s : scales(p, salt)) t.push_back(std::move(s));
  }
  return t;
}

float ScaleOf(int salt, int64_t block) { return 0.01f * static_cast<float>(salt) + 0.001f * block; }

// transformers' fine-grained FP8 with 4x4 blocks: weight_scale_inv [rows/4,
// cols/4] in float32 (the 12-wide projections have 3 blocks a row).
TEST(Fp8LoaderTest, LoadsFineGrainedBlocksAndDequantizes) {
  ScratchDir dir;
  nlohmann::json q = FineGrained();
  q["weight_block_size"] = {4, 4};
  WriteFile(dir.path() / "config.json", Config(q));
  WriteFile(dir.path() / "model.safetensors",
            SafetensorsBytes(Layer([](const Projection& p, int salt) {
              std::vector<float> s;
              for (int64_t b = 0; b < (p.rows / 4) * (p.cols / 4); ++b)
                s.push_back(ScaleOf(salt, b));
              return std::vector<TensorSpec>{{Name(p.module + ".weight_scale_inv"),
                                              "F32",
                                              {p.rows / 4, p.cols / 4},
                                              ScaleBytes(s, "F32")}};
            })));
  absl::StatusOr<ModelSpan> span = LoadModelSpan(dir.path(), LayerRange{}, "fp8");
  ASSERT_TRUE(span.ok()) << span.status();
  ASSERT_TRUE(span->config.fp8.has_value());
  const HostTensor& down = span->layers[0].down_proj;  // [8, 12]: 2 x 3 blocks
  EXPECT_EQ(down.dtype, DType::kF8E4M3);
  EXPECT_EQ(down.scale_block_rows, 4);
  EXPECT_EQ(down.scale_block_cols, 4);
  ASSERT_EQ(down.scale.size(), 6u);
  const std::vector<unsigned char> raw = Fp8Bytes(8 * 12, 7);
  const std::vector<float> values = down.ToFloat();
  for (int64_t r = 0; r < 8; ++r) {
    for (int64_t c = 0; c < 12; ++c) {
      const float want = Fp8E4M3ToFloat(raw[r * 12 + c]) * ScaleOf(7, (r / 4) * 3 + c / 4);
      EXPECT_FLOAT_EQ(values[r * 12 + c], want) << r << ", " << c;
    }
  }
  // Scales count as weight bytes; the log line names the format.
  EXPECT_THAT(span->Summary(),
              HasSubstr("fp32+f8_e4m3 weights, fp8 (transformers fine-grained: 4x4"));
  // Two F32 norms of 8, 480 FP8 values and 30 float32 scales (4 + 2 + 2 +
  // 4 blocks for q, k, v, o, 6 for each of gate, up and down).
  EXPECT_EQ(span->WeightBytes(), 2 * 8 * 4 + 480 + 30 * 4);
}

// compressed-tensors per channel (weight_scale [out, 1] in BF16, as
// llm-compressor saves a BF16 model's) with a static per-tensor input_scale.
TEST(Fp8LoaderTest, LoadsCompressedTensorsChannelScalesAndStaticInputScales) {
  ScratchDir dir;
  WriteFile(dir.path() / "config.json",
            Config(CompressedTensors("channel", Inputs("tensor", false))));
  WriteFile(
      dir.path() / "model.safetensors", SafetensorsBytes(Layer([](const Projection& p, int salt) {
        std::vector<float> s;
        for (int64_t r = 0; r < p.rows; ++r) s.push_back(0.25f * static_cast<float>(r + 1));
        // q, k and v share one input_scale, as gate and up do.
        const bool attention = p.module.starts_with("self_attn.") && p.module != "self_attn.o_proj";
        const bool gate_up = p.module == "mlp.gate_proj" || p.module == "mlp.up_proj";
        const float input = attention ? 0.5f : gate_up ? 0.75f : 0.125f * salt;
        return std::vector<TensorSpec>{
            {Name(p.module + ".weight_scale"), "BF16", {p.rows, 1}, ScaleBytes(s, "BF16")},
            {Name(p.module + ".input_scale"), "F32", {1}, ScaleBytes({input}, "F32")}};
      })));
  absl::StatusOr<ModelSpan> span = LoadModelSpan(dir.path(), LayerRange{}, "fp8");
  ASSERT_TRUE(span.ok()) << span.status();
  const LayerWeights& w = span->layers[0];
  EXPECT_EQ(w.q_proj.scale_block_rows, 1);
  EXPECT_EQ(w.q_proj.scale_block_cols, 8);
  EXPECT_EQ(w.q_proj.scale, (std::vector<float>{0.25f, 0.5f, 0.75f, 1, 1.25f, 1.5f, 1.75f, 2}));
  EXPECT_EQ(w.k_proj.input_scale, 0.5f);
  EXPECT_EQ(w.up_proj.input_scale, 0.75f);
  EXPECT_EQ(w.down_proj.input_scale, 0.875f);  // salt 7
  EXPECT_TRUE(CheckLayerWeights(w, span->config, 0).ok());
}

// Each broken checkpoint fails to load with a message naming what is wrong.
TEST(Fp8LoaderTest, RefusesBrokenFp8Checkpoints) {
  const auto fine_grained_scales = [](const Projection& p, int) {
    return std::vector<TensorSpec>{
        {Name(p.module + ".weight_scale_inv"), "F32", {1, 1}, ScaleBytes({0.5f}, "F32")}};
  };
  struct Case {
    std::string what;
    nlohmann::json quantization;
    std::vector<TensorSpec> tensors;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({"no quantization_config", nullptr, Layer(fine_grained_scales),
                   "has no quantization_config"});
  std::vector<TensorSpec> missing = Layer(fine_grained_scales);
  std::erase_if(missing,
                [](const TensorSpec& t) { return t.name == Name("mlp.up_proj.weight_scale_inv"); });
  cases.push_back({"a missing scale", FineGrained(), missing, "mlp.up_proj.weight_scale_inv"});
  cases.push_back({"scales of the wrong shape", CompressedTensors("channel", Inputs("token", true)),
                   Layer([](const Projection& p, int) {
                     return std::vector<TensorSpec>{
                         {Name(p.module + ".weight_scale"), "F32", {1}, ScaleBytes({0.5f}, "F32")}};
                   }),
                   "expected ["});
  cases.push_back(
      {"a zero scale", FineGrained(), Layer([](const Projection& p, int) {
         return std::vector<TensorSpec>{
             {Name(p.module + ".weight_scale_inv"), "F32", {1, 1}, ScaleBytes({0.0f}, "F32")}};
       }),
       "positive and finite"});
  std::vector<TensorSpec> fp8_norm = Layer(fine_grained_scales);
  fp8_norm[0] = {Name("input_layernorm.weight"), "F8_E4M3", {8}, Fp8Bytes(8, 0)};
  cases.push_back({"an FP8 norm", FineGrained(), fp8_norm, "not a weight matrix"});
  std::vector<TensorSpec> mixed = Layer(fine_grained_scales);
  for (TensorSpec& t : mixed) {
    if (t.name == Name("self_attn.k_proj.weight")) {
      t.dtype = "F32";
      t.bytes = testing_files::F32Bytes(std::vector<float>(32, 0.5f));
    }
  }
  cases.push_back({"FP8 q with BF16 k", FineGrained(), mixed, "q_proj, k_proj and v_proj"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ScratchDir dir;
    WriteFile(dir.path() / "config.json", Config(c.quantization));
    WriteFile(dir.path() / "model.safetensors", SafetensorsBytes(c.tensors));
    absl::StatusOr<ModelSpan> span = LoadModelSpan(dir.path(), LayerRange{}, "fp8");
    absl::Status status =
        span.ok() ? CheckLayerWeights(span->layers[0], span->config, 0) : span.status();
    ASSERT_FALSE(status.ok());
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
  }
}

}  // namespace
}  // namespace layerserve
