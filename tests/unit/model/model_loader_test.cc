// LoadModelSpan on tiny checkpoints written by the test (single file, two
// shards, biases, BF16 storage) and the error for each way a checkpoint can be
// wrong; ParseLayerRange; HostTensor helpers.
#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <map>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/model.h"
#include "tests/unit/model/test_files.h"

namespace layerserve {
namespace {

using ::testing::HasSubstr;
using testing_files::SafetensorsBytes;
using testing_files::ScratchDir;
using testing_files::TensorSpec;
using testing_files::WriteFile;

// hidden 8, intermediate 12, 2 heads of 4, 1 KV head, 3 layers.
std::string TinyConfig(const std::string& model_type) {
  return R"({"model_type": ")" + model_type + R"(", "hidden_size": 8,
    "intermediate_size": 12, "num_attention_heads": 2, "num_key_value_heads": 1,
    "num_hidden_layers": 3, "rms_norm_eps": 1e-5, "torch_dtype": "float32"})";
}

struct ModuleShape {
  std::string module;
  std::vector<int64_t> shape;
};

std::vector<ModuleShape> TinyModules(bool bias) {
  std::vector<ModuleShape> m = {
      {"input_layernorm.weight", {8}},     {"self_attn.q_proj.weight", {8, 8}},
      {"self_attn.k_proj.weight", {4, 8}}, {"self_attn.v_proj.weight", {4, 8}},
      {"self_attn.o_proj.weight", {8, 8}}, {"post_attention_layernorm.weight", {8}},
      {"mlp.gate_proj.weight", {12, 8}},   {"mlp.up_proj.weight", {12, 8}},
      {"mlp.down_proj.weight", {8, 12}},
  };
  if (bias) {
    m.push_back({"self_attn.q_proj.bias", {8}});
    m.push_back({"self_attn.k_proj.bias", {4}});
    m.push_back({"self_attn.v_proj.bias", {4}});
  }
  return m;
}

// Multiples of 1/8 in [-4, 4): exact in F32, F16 and BF16, distinct per
// layer and module so a mix-up shows.
float Pattern(int64_t layer, size_t module, int64_t i) {
  return static_cast<float>((layer * 31 + static_cast<int64_t>(module) * 7 + i) % 64) * 0.125f -
         4.0f;
}

std::string TensorName(int64_t layer, const std::string& module) {
  return "model.layers." + std::to_string(layer) + "." + module;
}

TensorSpec MakeTensor(int64_t layer, size_t module_index, const ModuleShape& m,
                      const std::string& dtype) {
  int64_t n = 1;
  for (int64_t d : m.shape) n *= d;
  std::vector<unsigned char> bytes;
  for (int64_t i = 0; i < n; ++i) {
    const float v = Pattern(layer, module_index, i);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    if (dtype == "BF16") {
      const uint16_t hi = static_cast<uint16_t>(bits >> 16);  // exact for these values
      bytes.push_back(static_cast<unsigned char>(hi & 0xff));
      bytes.push_back(static_cast<unsigned char>(hi >> 8));
    } else {
      for (int b = 0; b < 4; ++b) bytes.push_back(static_cast<unsigned char>(bits >> (8 * b)));
    }
  }
  return {TensorName(layer, m.module), dtype, m.shape, bytes};
}

std::vector<TensorSpec> LayerTensors(int64_t layer, bool bias, const std::string& dtype = "F32") {
  std::vector<TensorSpec> out;
  const std::vector<ModuleShape> modules = TinyModules(bias);
  for (size_t k = 0; k < modules.size(); ++k)
    out.push_back(MakeTensor(layer, k, modules[k], dtype));
  return out;
}

std::vector<TensorSpec> AllLayers(bool bias, const std::string& dtype = "F32") {
  std::vector<TensorSpec> out;
  for (int64_t layer = 0; layer < 3; ++layer) {
    for (TensorSpec& t : LayerTensors(layer, bias, dtype)) out.push_back(std::move(t));
  }
  // Non-layer tensors a real checkpoint carries; the loader must skip them.
  out.push_back({"model.embed_tokens.weight", "F32", {4, 8}, std::vector<unsigned char>(128, 0)});
  return out;
}

void WriteSingleFile(const std::filesystem::path& dir, const std::string& model_type,
                     const std::vector<TensorSpec>& tensors) {
  WriteFile(dir / "config.json", TinyConfig(model_type));
  WriteFile(dir / "model.safetensors", SafetensorsBytes(tensors));
}

const HostTensor& Field(const LayerWeights& w, const std::string& module) {
  static const std::map<std::string, HostTensor LayerWeights::*> kFields = {
      {"input_layernorm.weight", &LayerWeights::input_layernorm},
      {"self_attn.q_proj.weight", &LayerWeights::q_proj},
      {"self_attn.k_proj.weight", &LayerWeights::k_proj},
      {"self_attn.v_proj.weight", &LayerWeights::v_proj},
      {"self_attn.o_proj.weight", &LayerWeights::o_proj},
      {"post_attention_layernorm.weight", &LayerWeights::post_attention_layernorm},
      {"mlp.gate_proj.weight", &LayerWeights::gate_proj},
      {"mlp.up_proj.weight", &LayerWeights::up_proj},
      {"mlp.down_proj.weight", &LayerWeights::down_proj},
      {"self_attn.q_proj.bias", &LayerWeights::q_bias},
      {"self_attn.k_proj.bias", &LayerWeights::k_bias},
      {"self_attn.v_proj.bias", &LayerWeights::v_bias},
  };
  return w.*kFields.at(module);
}

// Every tensor of every loaded layer has the expected shape and values.
void ExpectLayersMatch(const ModelSpan& span, int64_t first, int64_t count, bool bias,
                       DType dtype) {
  ASSERT_EQ(span.first_layer, first);
  ASSERT_EQ(static_cast<int64_t>(span.layers.size()), count);
  const std::vector<ModuleShape> modules = TinyModules(bias);
  for (int64_t l = 0; l < count; ++l) {
    for (size_t k = 0; k < modules.size(); ++k) {
      SCOPED_TRACE(TensorName(first + l, modules[k].module));
      const HostTensor& t = Field(span.layers[l], modules[k].module);
      EXPECT_EQ(t.dtype, dtype);
      ASSERT_EQ(t.shape, modules[k].shape);
      const std::vector<float> values = t.ToFloat();
      ASSERT_EQ(static_cast<int64_t>(values.size()), t.NumElements());
      for (size_t i = 0; i < values.size(); ++i) {
        ASSERT_EQ(values[i], Pattern(first + l, k, static_cast<int64_t>(i))) << "element " << i;
      }
    }
    if (!bias) {
      EXPECT_EQ(span.layers[l].q_bias.NumElements(), 0);
    }
  }
}

TEST(LoadModelSpanTest, SingleFileRange) {
  ScratchDir dir;
  WriteSingleFile(dir.path(), "llama", AllLayers(false));
  auto span = LoadModelSpan(dir.path(), LayerRange{1, 3}, "tiny");
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_EQ(span->name, "tiny");
  EXPECT_EQ(span->config.hidden_size, 8);
  ExpectLayersMatch(*span, 1, 2, false, DType::kF32);
  // Per layer: 8+64+32+32+64+8+96+96+96 floats.
  EXPECT_EQ(span->WeightBytes(), 2u * 496u * 4u);
}

TEST(LoadModelSpanTest, OpenRangeMeansAllLayers) {
  ScratchDir dir;
  WriteSingleFile(dir.path(), "llama", AllLayers(false));
  auto span = LoadModelSpan(dir.path(), LayerRange{}, "tiny");
  ASSERT_TRUE(span.ok()) << span.status();
  ExpectLayersMatch(*span, 0, 3, false, DType::kF32);
}

TEST(LoadModelSpanTest, Qwen2LoadsBiases) {
  ScratchDir dir;
  WriteSingleFile(dir.path(), "qwen2", AllLayers(true));
  auto span = LoadModelSpan(dir.path(), LayerRange{0, 2}, "tiny");
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_TRUE(span->config.attention_bias);
  ExpectLayersMatch(*span, 0, 2, true, DType::kF32);
}

TEST(LoadModelSpanTest, Bf16StorageIsKept) {
  ScratchDir dir;
  WriteSingleFile(dir.path(), "llama", AllLayers(false, "BF16"));
  auto span = LoadModelSpan(dir.path(), LayerRange{2, 3}, "tiny");
  ASSERT_TRUE(span.ok()) << span.status();
  ExpectLayersMatch(*span, 2, 1, false, DType::kBF16);
  EXPECT_EQ(span->WeightBytes(), 496u * 2u);
}

TEST(LoadModelSpanTest, TwoShardIndex) {
  ScratchDir dir;
  WriteFile(dir.path() / "config.json", TinyConfig("qwen2"));
  std::vector<TensorSpec> shard1 = LayerTensors(0, true);
  for (TensorSpec& t : LayerTensors(1, true)) shard1.push_back(std::move(t));
  const std::vector<TensorSpec> shard2 = LayerTensors(2, true);
  WriteFile(dir.path() / "model-00001-of-00002.safetensors", SafetensorsBytes(shard1));
  WriteFile(dir.path() / "model-00002-of-00002.safetensors", SafetensorsBytes(shard2));
  nlohmann::json index;
  index["metadata"] = {{"total_size", 0}};
  for (const TensorSpec& t : shard1)
    index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const TensorSpec& t : shard2)
    index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  WriteFile(dir.path() / "model.safetensors.index.json", index.dump());

  auto span = LoadModelSpan(dir.path(), LayerRange{1, 3}, "tiny");
  ASSERT_TRUE(span.ok()) << span.status();
  ExpectLayersMatch(*span, 1, 2, true, DType::kF32);

  // A tensor the index does not list: the error names the index and tensor.
  index["weight_map"].erase("model.layers.2.mlp.gate_proj.weight");
  WriteFile(dir.path() / "model.safetensors.index.json", index.dump());
  auto missing = LoadModelSpan(dir.path(), LayerRange{1, 3}, "tiny");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("model.safetensors.index.json"));
  EXPECT_THAT(missing.status().message(), HasSubstr("'model.layers.2.mlp.gate_proj.weight'"));

  // The index points at a shard that lacks the tensor.
  index["weight_map"]["model.layers.2.mlp.gate_proj.weight"] = "model-00001-of-00002.safetensors";
  WriteFile(dir.path() / "model.safetensors.index.json", index.dump());
  auto misplaced = LoadModelSpan(dir.path(), LayerRange{1, 3}, "tiny");
  EXPECT_EQ(misplaced.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(misplaced.status().message(), HasSubstr("model-00001-of-00002.safetensors"));
  EXPECT_THAT(misplaced.status().message(), HasSubstr("'model.layers.2.mlp.gate_proj.weight'"));

  // Shards must stay inside the checkpoint directory.
  index["weight_map"]["model.layers.2.mlp.gate_proj.weight"] = "../elsewhere.safetensors";
  WriteFile(dir.path() / "model.safetensors.index.json", index.dump());
  auto escaped = LoadModelSpan(dir.path(), LayerRange{1, 3}, "tiny");
  EXPECT_EQ(escaped.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(escaped.status().message(), HasSubstr("outside the checkpoint directory"));
}

TEST(LoadModelSpanTest, MissingTensorNamesFileAndTensor) {
  ScratchDir dir;
  std::vector<TensorSpec> tensors = AllLayers(false);
  std::erase_if(
      tensors, [](const TensorSpec& t) { return t.name == "model.layers.1.mlp.down_proj.weight"; });
  WriteSingleFile(dir.path(), "llama", tensors);
  EXPECT_TRUE(LoadModelSpan(dir.path(), LayerRange{2, 3}, "tiny").ok());  // not needed there
  auto span = LoadModelSpan(dir.path(), LayerRange{0, 2}, "tiny");
  EXPECT_EQ(span.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(span.status().message(),
            (dir.path() / "model.safetensors").string() +
                ": tensor 'model.layers.1.mlp.down_proj.weight' is missing");
}

// Qwen3: each layer's q_norm and k_norm ([head_dim]) beside the Llama tensors.
std::vector<TensorSpec> Qwen3Layers() {
  std::vector<TensorSpec> out = AllLayers(false);
  for (int64_t layer = 0; layer < 3; ++layer) {
    out.push_back(MakeTensor(layer, 20, {"self_attn.q_norm.weight", {4}}, "F32"));
    out.push_back(MakeTensor(layer, 21, {"self_attn.k_norm.weight", {4}}, "F32"));
  }
  return out;
}

TEST(LoadModelSpanTest, Qwen3LoadsHeadNorms) {
  ScratchDir dir;
  WriteSingleFile(dir.path(), "qwen3", Qwen3Layers());
  auto span = LoadModelSpan(dir.path(), LayerRange{1, 3}, "tiny");
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_TRUE(span->config.qk_norm);
  ExpectLayersMatch(*span, 1, 2, false, DType::kF32);
  for (int64_t l = 0; l < 2; ++l) {
    const LayerWeights& w = span->layers[static_cast<size_t>(l)];
    for (int64_t i = 0; i < 4; ++i) {
      EXPECT_EQ(w.q_norm.ToFloat()[i], Pattern(1 + l, 20, i));
      EXPECT_EQ(w.k_norm.ToFloat()[i], Pattern(1 + l, 21, i));
    }
    EXPECT_TRUE(CheckLayerWeights(w, span->config, 1 + l).ok());
  }
  std::vector<TensorSpec> missing = Qwen3Layers();
  std::erase_if(missing, [](const TensorSpec& t) {
    return t.name == "model.layers.2.self_attn.k_norm.weight";
  });
  ScratchDir other;
  WriteSingleFile(other.path(), "qwen3", missing);
  auto refused = LoadModelSpan(other.path(), LayerRange{}, "tiny");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(refused.status().message(), HasSubstr("'model.layers.2.self_attn.k_norm.weight'"));
}

TEST(LoadModelSpanTest, MissingBiasForQwen2) {
  ScratchDir dir;
  WriteSingleFile(dir.path(), "qwen2", AllLayers(false));
  auto span = LoadModelSpan(dir.path(), LayerRange{0, 1}, "tiny");
  EXPECT_EQ(span.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(span.status().message(), HasSubstr("'model.layers.0.self_attn.q_proj.bias'"));
}

TEST(LoadModelSpanTest, WrongShapeNamesFileTensorAndShapes) {
  ScratchDir dir;
  std::vector<TensorSpec> tensors = AllLayers(false);
  for (TensorSpec& t : tensors) {
    if (t.name == "model.layers.1.mlp.up_proj.weight") {
      t.shape = {10, 8};
      t.bytes.resize(10 * 8 * 4);
    }
  }
  WriteSingleFile(dir.path(), "llama", tensors);
  auto span = LoadModelSpan(dir.path(), LayerRange{}, "tiny");
  EXPECT_EQ(span.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(span.status().message(),
            (dir.path() / "model.safetensors").string() +
                ": tensor 'model.layers.1.mlp.up_proj.weight' has shape [10, 8], expected [12, 8]");
}

TEST(LoadModelSpanTest, UnsupportedWeightDtype) {
  ScratchDir dir;
  std::vector<TensorSpec> tensors = AllLayers(false);
  for (TensorSpec& t : tensors) {
    if (t.name == "model.layers.0.input_layernorm.weight") {
      t.dtype = "F64";
      t.bytes.resize(8 * 8);
    }
  }
  WriteSingleFile(dir.path(), "llama", tensors);
  auto span = LoadModelSpan(dir.path(), LayerRange{}, "tiny");
  EXPECT_EQ(span.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(span.status().message(), HasSubstr("'model.layers.0.input_layernorm.weight'"));
  EXPECT_THAT(span.status().message(), HasSubstr("F64"));
}

TEST(LoadModelSpanTest, RangeOutsideModel) {
  ScratchDir dir;
  WriteSingleFile(dir.path(), "llama", AllLayers(false));
  for (const LayerRange& range : {LayerRange{2, 5}, LayerRange{3, std::nullopt},
                                  LayerRange{std::nullopt, 4}, LayerRange{2, 2}}) {
    auto span = LoadModelSpan(dir.path(), range, "tiny");
    EXPECT_EQ(span.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(span.status().message(), HasSubstr("outside the 3 layers"));
    EXPECT_THAT(span.status().message(), HasSubstr("config.json"));
  }
}

TEST(LoadModelSpanTest, MissingFiles) {
  ScratchDir dir;
  auto no_config = LoadModelSpan(dir.path(), LayerRange{}, "tiny");
  EXPECT_EQ(no_config.status().code(), absl::StatusCode::kNotFound);
  // The file and the reason (issue 37: "config.json: cannot open" gave none).
  EXPECT_THAT(no_config.status().message(),
              HasSubstr("config.json: cannot be read: No such file or directory"));

  WriteFile(dir.path() / "config.json", TinyConfig("llama"));
  auto no_weights = LoadModelSpan(dir.path(), LayerRange{}, "tiny");
  EXPECT_EQ(no_weights.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_weights.status().message(), HasSubstr("model.safetensors"));

  WriteFile(dir.path() / "config.json", R"({"model_type": "llama"})");
  auto bad_config = LoadModelSpan(dir.path(), LayerRange{}, "tiny");
  EXPECT_EQ(bad_config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_config.status().message(), HasSubstr("config.json"));
}

TEST(ParseLayerRangeTest, Table) {
  struct Case {
    std::string text;
    bool ok;
    std::optional<int64_t> begin;
    std::optional<int64_t> end;
  };
  const std::vector<Case> cases = {
      {"0:4", true, 0, 4},
      {"2:3", true, 2, 3},
      {":4", true, std::nullopt, 4},
      {"10:", true, 10, std::nullopt},
      {":", true, std::nullopt, std::nullopt},
      {"", true, std::nullopt, std::nullopt},
      {"3:3", false, {}, {}},
      {"4:2", false, {}, {}},
      {"5", false, {}, {}},
      {"1:2:3", false, {}, {}},
      {"-1:2", false, {}, {}},
      {"a:b", false, {}, {}},
      {" 1:2", false, {}, {}},
      {"1:2 ", false, {}, {}},
      {"1.5:3", false, {}, {}},
      {"99999999999999999999:", false, {}, {}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("'" + c.text + "'");
    auto range = ParseLayerRange(c.text);
    ASSERT_EQ(range.ok(), c.ok) << range.status();
    if (!c.ok) {
      EXPECT_EQ(range.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(range.status().message(), HasSubstr("'" + c.text + "'"));
      continue;
    }
    EXPECT_EQ(range->begin, c.begin);
    EXPECT_EQ(range->end, c.end);
  }
}

TEST(HostTensorTest, NumElementsAndToFloat) {
  HostTensor empty;
  EXPECT_EQ(empty.NumElements(), 0);
  EXPECT_TRUE(empty.ToFloat().empty());

  HostTensor f16;
  f16.dtype = DType::kF16;
  f16.shape = {2, 2};
  // 1.0, -2.0, 0.5, 65504 (fp16 max)
  f16.data = {0x00, 0x3c, 0x00, 0xc0, 0x00, 0x38, 0xff, 0x7b};
  EXPECT_EQ(f16.NumElements(), 4);
  EXPECT_EQ(f16.ToFloat(), (std::vector<float>{1.0f, -2.0f, 0.5f, 65504.0f}));

  HostTensor bf16;
  bf16.dtype = DType::kBF16;
  bf16.shape = {3};
  bf16.data = {0x80, 0x3f, 0x40, 0xc0, 0x00, 0x00};  // 1.0, -3.0, 0.0
  EXPECT_EQ(bf16.ToFloat(), (std::vector<float>{1.0f, -3.0f, 0.0f}));
}

// Each file the loader reads may be a FIFO by mistake (or malice); none may
// block start-up, which no signal could then end. Each load runs on a thread
// with a time limit, so a regression fails instead of hanging; a writer is
// opened on each FIFO afterwards to release a blocked reader.
TEST(LoadModelSpanTest, RefusesFifosWithoutBlocking) {
  for (const std::string fifo_name :
       {"config.json", "model.safetensors", "model.safetensors.index.json"}) {
    SCOPED_TRACE(fifo_name);
    ScratchDir dir;
    if (fifo_name != "config.json") WriteFile(dir.path() / "config.json", TinyConfig("llama"));
    const std::filesystem::path fifo = dir.path() / fifo_name;
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
    auto loading = std::async(std::launch::async,
                              [&] { return LoadModelSpan(dir.path(), LayerRange{}, "tiny"); });
    const bool finished = loading.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
    if (!finished) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
    }
    const auto span = loading.get();
    EXPECT_TRUE(finished) << "loading blocked on the FIFO " << fifo_name;
    ASSERT_FALSE(span.ok());
    EXPECT_EQ(span.status().code(), absl::StatusCode::kInvalidArgument) << span.status();
    EXPECT_THAT(span.status().message(), HasSubstr(fifo_name + ": is not a regular file"));
  }
}

}  // namespace
}  // namespace layerserve
