// Loading a span of decoder layers from a Hugging Face checkpoint directory
// (LoadModelSpan), plus the small HostTensor / ModelSpan / LayerRange helpers
// declared in model.h.
//
// Only the tensors of the requested layers are copied out of the mmapped
// safetensors files, so a server holding 4 of 80 layers reads 4 layers' worth.
// Every shape is checked against config.json before the copy; each error is one
// line naming the file and the tensor.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/regular_file.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/model/model.h"
#include "server/model/safetensors.h"

namespace layerserve {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// config.json or the shard index, through base's ReadRegularFile (opened
// without blocking and refused unless a regular file: reading a FIFO would
// wait for a writer forever, and a signal would not end start-up); errors
// name the file and the reason.
absl::StatusOr<std::string> ReadTextFile(const std::filesystem::path& path) {
  // config.json is a few KB; a shard index of the largest models a few MB.
  constexpr size_t kMaxJsonBytes = size_t{64} << 20;
  absl::StatusOr<std::string> text = ReadRegularFile(path.string(), kMaxJsonBytes);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat(path.string(), ": ", text.status().message()));
  }
  return text;
}

// Non-negative decimal integer, digits only.
std::optional<int64_t> ParseIndex(std::string_view text) {
  if (text.empty() || text.size() > 18) return std::nullopt;
  int64_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + (c - '0');
  }
  return value;
}

// Where each tensor lives: one model.safetensors, or the shards named by
// model.safetensors.index.json. Shards are opened (mapped) on first use.
class CheckpointFiles {
 public:
  static absl::StatusOr<CheckpointFiles> Open(const std::filesystem::path& dir) {
    CheckpointFiles files;
    files.dir_ = dir;
    const std::filesystem::path index_path = dir / "model.safetensors.index.json";
    if (std::filesystem::exists(index_path)) {
      files.index_path_ = index_path;
      LS_ASSIGN_OR_RETURN(const std::string text, ReadTextFile(index_path));
      const nlohmann::json index =
          nlohmann::json::parse(text, /*cb=*/nullptr, /*allow_exceptions=*/false);
      if (index.is_discarded() || !index.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path.string(), ": not a valid JSON object"));
      }
      const auto map_it = index.find("weight_map");
      if (map_it == index.end() || !map_it->is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path.string(), ": missing object 'weight_map'"));
      }
      for (const auto& [tensor, file] : map_it->items()) {
        if (!file.is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(
              index_path.string(), ": weight_map entry for '", tensor, "' is not a string"));
        }
        const std::filesystem::path shard(file.get<std::string>());
        // Shards must stay inside the checkpoint directory.
        if (shard.empty() || shard.is_absolute() ||
            std::find(shard.begin(), shard.end(), std::filesystem::path("..")) != shard.end()) {
          return absl::InvalidArgumentError(
              absl::StrCat(index_path.string(), ": weight_map entry for '", tensor, "' names '",
                           shard.string(), "', outside the checkpoint directory"));
        }
        files.weight_map_.emplace(tensor, shard.string());
      }
    } else {
      const std::filesystem::path single = dir / "model.safetensors";
      LS_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(single));
      files.single_ = std::make_unique<SafetensorsFile>(std::move(file));
    }
    return files;
  }

  // Set for an FP8 checkpoint (LlamaConfig::fp8): how its FP8 weights'
  // scales are named and laid out (LoadTensor).
  std::optional<Fp8Quantization> fp8;

  bool Contains(const std::string& tensor) const {
    return single_ ? single_->Contains(tensor) : weight_map_.contains(tensor);
  }

  absl::StatusOr<const SafetensorsFile*> FileFor(const std::string& tensor) {
    if (single_) {
      if (!single_->Contains(tensor)) {
        return absl::NotFoundError(
            absl::StrCat(single_->path().string(), ": tensor '", tensor, "' is missing"));
      }
      return single_.get();
    }
    const auto it = weight_map_.find(tensor);
    if (it == weight_map_.end()) {
      return absl::NotFoundError(
          absl::StrCat(index_path_.string(), ": tensor '", tensor, "' is missing from weight_map"));
    }
    auto shard_it = shards_.find(it->second);
    if (shard_it == shards_.end()) {
      LS_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(dir_ / it->second));
      shard_it = shards_.emplace(it->second, std::move(file)).first;
    }
    if (!shard_it->second.Contains(tensor)) {
      return absl::NotFoundError(absl::StrCat(shard_it->second.path().string(), ": tensor '",
                                              tensor, "' is missing (", index_path_.string(),
                                              " says it is here)"));
    }
    return &shard_it->second;
  }

 private:
  std::filesystem::path dir_;
  std::filesystem::path index_path_;
  std::unique_ptr<SafetensorsFile> single_;
  std::map<std::string, std::string> weight_map_;
  std::map<std::string, SafetensorsFile> shards_;
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A scale tensor (F32, BF16 or F16) of `elements` values, as float32.
absl::StatusOr<std::vector<float>> LoadScales(CheckpointFiles& files, const std::string& name,
                                              int64_t elements, std::string_view expected) {
  LS_ASSIGN_OR_RETURN(const SafetensorsFile* file, files.FileFor(name));
  LS_ASSIGN_OR_RETURN(SafetensorsTensor view, file->Get(name));
  int64_t count = 1;
  for (const int64_t d : view.shape) count *= d;
  if (count != elements || view.dtype == DType::kF8E4M3) {
    return absl::InvalidArgumentError(absl::StrCat(
        file->path().string(), ": scale tensor '", name, "' is ",
        ToAbsl(DTypeProtocolName(view.dtype)), " ", ShapeString(view.shape), ", expected ",
        ToAbsl(expected), " (", elements, " float32, bf16 or fp16 values)"));
  }
  std::vector<float> scales(static_cast<size_t>(elements));
  ConvertToFloat(view.dtype, view.data.data(), scales.size(), scales.data());
  for (const float v : scales) {
    if (!(v > 0) || !std::isfinite(v)) {
      return absl::InvalidArgumentError(absl::StrCat(file->path().string(), ": scale tensor '",
                                                     name, "' holds ", v,
                                                     "; scales must be positive and finite"));
    }
  }
  return scales;
}

// The scales of the FP8 weight `name` ([..., rows, cols]) into `tensor`, as
// its checkpoint's format names and lays them out: transformers' fine-grained
// FP8 "<name>_scale_inv" [..., ceil(rows / 128), ceil(cols / 128)];
// compressed-tensors "<name>_scale" ([rows, 1] per channel, [1] per tensor,
// or a block grid) and, with static activations, "<module>.input_scale".
absl::Status LoadFp8Scales(CheckpointFiles& files, const std::string& name, HostTensor& tensor) {
  if (!files.fp8) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name,
                     "' is F8_E4M3 but config.json has no quantization_config naming an FP8 "
                     "format (fp8 or compressed-tensors)"));
  }
  const Fp8Quantization& q = *files.fp8;
  const int64_t rows = tensor.shape[tensor.shape.size() - 2];
  const int64_t cols = tensor.shape.back();
  tensor.scale_block_rows = q.weight_block_rows > 0 ? q.weight_block_rows : rows;
  tensor.scale_block_cols = q.weight_block_cols > 0 ? q.weight_block_cols : cols;
  const HostTensor::ScaleGrid grid = tensor.Fp8ScaleGrid();
  std::vector<int64_t> grid_shape(tensor.shape.begin(), tensor.shape.end() - 2);
  grid_shape.push_back(grid.rows);
  grid_shape.push_back(grid.cols);
  const bool fine_grained = q.format == Fp8Quantization::Format::kFineGrained;
  LS_ASSIGN_OR_RETURN(tensor.scale,
                      LoadScales(files, name + (fine_grained ? "_scale_inv" : "_scale"),
                                 grid.Blocks(), ShapeString(grid_shape)));
  if (q.activations != Fp8Quantization::Activations::kStaticPerTensor) return absl::OkStatus();
  constexpr std::string_view kWeight = "weight";
  if (!name.ends_with(kWeight)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "': static activation scales are read only for <module>.weight"));
  }
  const std::string input_scale = name.substr(0, name.size() - kWeight.size()) + "input_scale";
  LS_ASSIGN_OR_RETURN(const std::vector<float> input, LoadScales(files, input_scale, 1, "[1]"));
  tensor.input_scale = input[0];
  return absl::OkStatus();
}

absl::StatusOr<HostTensor> LoadTensor(CheckpointFiles& files, const std::string& name,
                                      const std::vector<int64_t>& expected_shape) {
  LS_ASSIGN_OR_RETURN(const SafetensorsFile* file, files.FileFor(name));
  LS_ASSIGN_OR_RETURN(SafetensorsTensor view, file->Get(name));
  if (view.shape != expected_shape) {
    return absl::InvalidArgumentError(absl::StrCat(file->path().string(), ": tensor '", name,
                                                   "' has shape ", ShapeString(view.shape),
                                                   ", expected ", ShapeString(expected_shape)));
  }
  HostTensor tensor;
  tensor.dtype = view.dtype;
  tensor.shape = std::move(view.shape);
  tensor.data.assign(view.data.begin(), view.data.end());
  if (tensor.dtype == DType::kF8E4M3) {
    if (tensor.shape.size() < 2) {
      return absl::InvalidArgumentError(absl::StrCat(file->path().string(), ": tensor '", name,
                                                     "' is F8_E4M3 but not a weight matrix"));
    }
    LS_RETURN_IF_ERROR(LoadFp8Scales(files, name, tensor));
  }
  return tensor;
}

// Appends `part` to the stacked tensor `dst` (whose shape the caller sets);
// every part must have the dtype of the first.
absl::Status AppendPart(HostTensor& dst, const HostTensor& part, const std::string& name) {
  if (dst.data.empty()) {
    dst.dtype = part.dtype;
    dst.scale_block_rows = part.scale_block_rows;
    dst.scale_block_cols = part.scale_block_cols;
  } else if (part.dtype != dst.dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' is ", ToAbsl(DTypeProtocolName(part.dtype)),
                     " but the experts before it are ", ToAbsl(DTypeProtocolName(dst.dtype)),
                     "; one layer's experts must share a dtype"));
  }
  if (part.input_scale != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': static activation scales on experts are not supported"));
  }
  // The stacked scales: one grid per expert's part, in order. Gate and up
  // rows of one expert stack into one grid when the block rows divide the
  // gate's rows (per channel always; 128-row blocks for any intermediate
  // size that is a multiple of 128).
  if (!part.scale.empty() && dst.scale_block_rows != part.scale_block_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' has ", part.scale_block_rows,
                     "-row weight-scale blocks where the experts before it have ",
                     dst.scale_block_rows, "; stack them per expert"));
  }
  dst.data.insert(dst.data.end(), part.data.begin(), part.data.end());
  dst.scale.insert(dst.scale.end(), part.scale.begin(), part.scale.end());
  return absl::OkStatus();
}

// Expert e's gate and up rows, then its down projection, appended to the
// stacked tensors from per-expert tensors named <expert><gate>, <up>, <down>.
absl::Status AppendExpert(CheckpointFiles& files, const LlamaConfig& c, const std::string& expert,
                          const std::array<const char*, 3>& parts, LayerWeights& w) {
  const int64_t hidden = c.hidden_size;
  const int64_t inter = c.intermediate_size;
  for (const char* part : {parts[0], parts[1]}) {
    const std::string name = expert + part;
    LS_ASSIGN_OR_RETURN(const HostTensor t, LoadTensor(files, name, {inter, hidden}));
    LS_RETURN_IF_ERROR(AppendPart(w.experts_gate_up, t, name));
  }
  const std::string name = expert + parts[2];
  LS_ASSIGN_OR_RETURN(const HostTensor t, LoadTensor(files, name, {hidden, inter}));
  return AppendPart(w.experts_down, t, name);
}

// A qwen2_moe or qwen3_moe layer's router, experts (fused as transformers 5
// holds them, or one module per expert as the published checkpoints store
// them) and shared expert (qwen2_moe).
absl::Status LoadQwenMoeExperts(CheckpointFiles& files, const LlamaConfig& c,
                                const std::string& prefix, LayerWeights& w) {
  const int64_t experts = c.num_experts;
  const int64_t hidden = c.hidden_size;
  const int64_t inter = c.intermediate_size;
  const std::string mlp = prefix + "mlp.";
  LS_ASSIGN_OR_RETURN(w.router, LoadTensor(files, mlp + "gate.weight", {experts, hidden}));
  if (files.Contains(mlp + "experts.gate_up_proj")) {
    LS_ASSIGN_OR_RETURN(w.experts_gate_up, LoadTensor(files, mlp + "experts.gate_up_proj",
                                                      {experts, 2 * inter, hidden}));
    LS_ASSIGN_OR_RETURN(w.experts_down,
                        LoadTensor(files, mlp + "experts.down_proj", {experts, hidden, inter}));
  } else {
    w.experts_gate_up.shape = {experts, 2 * inter, hidden};
    w.experts_down.shape = {experts, hidden, inter};
    for (int64_t e = 0; e < experts; ++e) {
      LS_RETURN_IF_ERROR(AppendExpert(files, c, absl::StrCat(mlp, "experts.", e, "."),
                                      {"gate_proj.weight", "up_proj.weight", "down_proj.weight"},
                                      w));
    }
  }
  if (!c.HasSharedExpert()) return absl::OkStatus();
  const int64_t shared = c.shared_expert_intermediate_size;
  const std::string expert = mlp + "shared_expert.";
  LS_ASSIGN_OR_RETURN(w.shared_gate_proj,
                      LoadTensor(files, expert + "gate_proj.weight", {shared, hidden}));
  LS_ASSIGN_OR_RETURN(w.shared_up_proj,
                      LoadTensor(files, expert + "up_proj.weight", {shared, hidden}));
  LS_ASSIGN_OR_RETURN(w.shared_down_proj,
                      LoadTensor(files, expert + "down_proj.weight", {hidden, shared}));
  LS_ASSIGN_OR_RETURN(w.shared_expert_gate,
                      LoadTensor(files, mlp + "shared_expert_gate.weight", {1, hidden}));
  return absl::OkStatus();
}

// A mixtral layer's router and stacked experts (LayerWeights), from either
// layout LoadModelSpan accepts: transformers 5's when the layer has its
// mlp.gate.weight, else the published one (whose errors a checkpoint missing
// both will then name).
absl::Status LoadExperts(CheckpointFiles& files, const LlamaConfig& c, const std::string& prefix,
                         LayerWeights& w) {
  const int64_t experts = c.num_experts;
  const int64_t hidden = c.hidden_size;
  const int64_t inter = c.intermediate_size;
  if (c.model_type == "qwen2_moe" || c.model_type == "qwen3_moe") {
    return LoadQwenMoeExperts(files, c, prefix, w);
  }
  const std::string published = absl::StrCat(prefix, "block_sparse_moe.");
  if (files.Contains(prefix + "mlp.gate.weight")) {
    LS_ASSIGN_OR_RETURN(w.router, LoadTensor(files, prefix + "mlp.gate.weight", {experts, hidden}));
    LS_ASSIGN_OR_RETURN(w.experts_gate_up, LoadTensor(files, prefix + "mlp.experts.gate_up_proj",
                                                      {experts, 2 * inter, hidden}));
    LS_ASSIGN_OR_RETURN(w.experts_down, LoadTensor(files, prefix + "mlp.experts.down_proj",
                                                   {experts, hidden, inter}));
    return absl::OkStatus();
  }
  LS_ASSIGN_OR_RETURN(w.router, LoadTensor(files, published + "gate.weight", {experts, hidden}));
  w.experts_gate_up.shape = {experts, 2 * inter, hidden};
  w.experts_down.shape = {experts, hidden, inter};
  for (int64_t e = 0; e < experts; ++e) {
    // Per expert: w1 (gate) rows, then w3 (up) rows, as gate_up_proj holds them.
    LS_RETURN_IF_ERROR(AppendExpert(files, c, absl::StrCat(published, "experts.", e, "."),
                                    {"w1.weight", "w3.weight", "w2.weight"}, w));
  }
  return absl::OkStatus();
}

absl::StatusOr<LayerWeights> LoadLayer(CheckpointFiles& files, const LlamaConfig& c,
                                       int64_t layer) {
  const std::string prefix = absl::StrCat("model.layers.", layer, ".");
  const int64_t q_dim = c.num_attention_heads * c.head_dim;
  const int64_t kv_dim = c.num_key_value_heads * c.head_dim;
  LayerWeights w;
  const auto load = [&](HostTensor& dst, std::string_view module,
                        std::vector<int64_t> shape) -> absl::Status {
    LS_ASSIGN_OR_RETURN(dst, LoadTensor(files, absl::StrCat(prefix, ToAbsl(module)), shape));
    return absl::OkStatus();
  };
  LS_RETURN_IF_ERROR(load(w.input_layernorm, "input_layernorm.weight", {c.hidden_size}));
  LS_RETURN_IF_ERROR(load(w.q_proj, "self_attn.q_proj.weight", {q_dim, c.hidden_size}));
  LS_RETURN_IF_ERROR(load(w.k_proj, "self_attn.k_proj.weight", {kv_dim, c.hidden_size}));
  LS_RETURN_IF_ERROR(load(w.v_proj, "self_attn.v_proj.weight", {kv_dim, c.hidden_size}));
  if (c.attention_bias) {
    LS_RETURN_IF_ERROR(load(w.q_bias, "self_attn.q_proj.bias", {q_dim}));
    LS_RETURN_IF_ERROR(load(w.k_bias, "self_attn.k_proj.bias", {kv_dim}));
    LS_RETURN_IF_ERROR(load(w.v_bias, "self_attn.v_proj.bias", {kv_dim}));
  }
  if (c.qk_norm) {
    LS_RETURN_IF_ERROR(load(w.q_norm, "self_attn.q_norm.weight", {c.head_dim}));
    LS_RETURN_IF_ERROR(load(w.k_norm, "self_attn.k_norm.weight", {c.head_dim}));
  }
  LS_RETURN_IF_ERROR(load(w.o_proj, "self_attn.o_proj.weight", {c.hidden_size, q_dim}));
  LS_RETURN_IF_ERROR(
      load(w.post_attention_layernorm, "post_attention_layernorm.weight", {c.hidden_size}));
  if (c.IsMixtureOfExperts()) {
    LS_RETURN_IF_ERROR(LoadExperts(files, c, prefix, w));
    return w;
  }
  LS_RETURN_IF_ERROR(
      load(w.gate_proj, "mlp.gate_proj.weight", {c.intermediate_size, c.hidden_size}));
  LS_RETURN_IF_ERROR(load(w.up_proj, "mlp.up_proj.weight", {c.intermediate_size, c.hidden_size}));
  LS_RETURN_IF_ERROR(
      load(w.down_proj, "mlp.down_proj.weight", {c.hidden_size, c.intermediate_size}));
  return w;
}

}  // namespace

int64_t HostTensor::NumElements() const {
  // A default-constructed tensor (an absent bias) holds nothing; the loader
  // never produces rank-0 tensors.
  if (shape.empty()) return 0;
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

HostTensor::ScaleGrid HostTensor::Fp8ScaleGrid() const {
  const int64_t rows = shape[shape.size() - 2];
  const int64_t cols = shape.back();
  int64_t lead = 1;
  for (size_t i = 0; i + 2 < shape.size(); ++i) lead *= shape[i];
  return {lead, CeilDiv(rows, scale_block_rows), CeilDiv(cols, scale_block_cols)};
}

std::vector<float> HostTensor::ToFloat() const {
  std::vector<float> out(static_cast<size_t>(NumElements()));
  // `data` holds exactly that many elements by construction; the min only
  // keeps a hand-built, inconsistent tensor from reading past its buffer.
  const size_t count = std::min(out.size(), data.size() / DTypeSize(dtype));
  ConvertToFloat(dtype, data.data(), count, out.data());
  if (dtype != DType::kF8E4M3 || shape.size() < 2 || scale_block_rows <= 0 ||
      scale_block_cols <= 0) {
    return out;
  }
  const int64_t rows = shape[shape.size() - 2];
  const int64_t cols = shape.back();
  const ScaleGrid grid = Fp8ScaleGrid();
  if (scale.size() != static_cast<size_t>(grid.Blocks())) return out;  // see CheckLayerWeights
  for (int64_t l = 0; l < grid.lead; ++l) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* scale_row = scale.data() + (l * grid.rows + r / scale_block_rows) * grid.cols;
      float* row = out.data() + (l * rows + r) * cols;
      for (int64_t c = 0; c < cols; ++c) row[c] *= scale_row[c / scale_block_cols];
    }
  }
  return out;
}

std::vector<const HostTensor*> LayerWeights::All() const {
  return {&input_layernorm,
          &q_proj,
          &k_proj,
          &v_proj,
          &q_bias,
          &k_bias,
          &v_bias,
          &o_proj,
          &post_attention_layernorm,
          &gate_proj,
          &up_proj,
          &down_proj,
          &router,
          &experts_gate_up,
          &experts_down,
          &shared_gate_proj,
          &shared_up_proj,
          &shared_down_proj,
          &shared_expert_gate,
          &q_norm,
          &k_norm};
}

size_t ModelSpan::WeightBytes() const {
  size_t bytes = 0;
  for (const LayerWeights& w : layers) {
    for (const HostTensor* t : w.All()) bytes += t->Bytes();
  }
  return bytes;
}

std::string ModelSpan::WeightDTypes() const {
  std::vector<std::string> names;
  for (const LayerWeights& w : layers) {
    for (const HostTensor* t : w.All()) {
      if (t->data.empty()) continue;  // an absent bias, or the other kind of MLP
      const std::string name = absl::AsciiStrToLower(ToAbsl(DTypeProtocolName(t->dtype)));
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    }
  }
  return absl::StrJoin(names, "+");
}

std::string ModelSpan::Summary() const {
  const std::string dtypes = WeightDTypes();
  const std::string experts =
      config.IsMixtureOfExperts()
          ? absl::StrCat(
                ", ", config.num_experts, " experts, top ", config.experts_per_token,
                config.HasSharedExpert()
                    ? absl::StrCat(", shared expert ", config.shared_expert_intermediate_size)
                    : "")
          : "";
  return absl::StrCat(
      name, " (", config.model_type, ", hidden ", config.hidden_size, ", ",
      config.num_attention_heads, " heads, ", config.num_key_value_heads, " kv heads, head_dim ",
      config.head_dim, experts, ", ", dtypes.empty() ? "no" : dtypes, " weights, ",
      config.fp8 ? absl::StrCat(config.fp8->Describe(), ", ") : "", DescribeRope(config),
      ") layers ", first_layer, ":", first_layer + static_cast<int64_t>(layers.size()), ", ",
      WeightBytes(), " weight bytes");
}

absl::StatusOr<LayerRange> ParseLayerRange(std::string_view text) {
  if (text.empty()) return LayerRange{};  // all layers, like ":"
  const size_t colon = text.find(':');
  if (colon == std::string_view::npos || text.find(':', colon + 1) != std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer range '", ToAbsl(text), "' must look like A:B, :B, A: or : (half-open)"));
  }
  LayerRange range;
  const std::string_view begin = text.substr(0, colon);
  const std::string_view end = text.substr(colon + 1);
  if (!begin.empty()) {
    range.begin = ParseIndex(begin);
    if (!range.begin) {
      return absl::InvalidArgumentError(absl::StrCat("layer range '", ToAbsl(text), "': '",
                                                     ToAbsl(begin), "' is not a layer index"));
    }
  }
  if (!end.empty()) {
    range.end = ParseIndex(end);
    if (!range.end) {
      return absl::InvalidArgumentError(absl::StrCat("layer range '", ToAbsl(text), "': '",
                                                     ToAbsl(end), "' is not a layer index"));
    }
  }
  if (range.begin && range.end && *range.begin >= *range.end) {
    return absl::InvalidArgumentError(absl::StrCat("layer range '", ToAbsl(text), "' is empty"));
  }
  return range;
}

namespace {

absl::Status CheckElements(const HostTensor& t, int64_t expected, int64_t layer,
                           std::string_view what) {
  if (t.NumElements() != expected ||
      t.data.size() != static_cast<size_t>(expected) * DTypeSize(t.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " ", ToAbsl(what), " has ",
                                                   t.NumElements(), " elements, expected ",
                                                   expected));
  }
  return absl::OkStatus();
}

// An FP8 tensor's scales cover its blocks exactly (HostTensor::scale); a
// tensor that may not be FP8 is not.
absl::Status CheckFp8(const HostTensor& t, bool may_be_fp8, int64_t layer, std::string_view what) {
  if (t.dtype != DType::kF8E4M3) return absl::OkStatus();
  if (!may_be_fp8) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " ", ToAbsl(what),
                     " is FP8: only the attention and MLP projections, the experts and the shared "
                     "expert's gate may be"));
  }
  if (t.shape.size() < 2 || t.scale_block_rows <= 0 || t.scale_block_cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " ", ToAbsl(what), " is FP8 without weight scales"));
  }
  const int64_t blocks = t.Fp8ScaleGrid().Blocks();
  if (t.scale.size() != static_cast<size_t>(blocks)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", layer, " ", ToAbsl(what), " has ", t.scale.size(), " weight scales for ", blocks,
        " blocks of ", t.scale_block_rows, "x", t.scale_block_cols,
        " (stacked experts whose gate rows are not a multiple of the block)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckLayerWeights(const LayerWeights& w, const LlamaConfig& c, int64_t layer) {
  const int64_t hidden = c.hidden_size;
  const int64_t q_dim = c.num_attention_heads * c.head_dim;
  const int64_t kv_dim = c.num_key_value_heads * c.head_dim;
  const int64_t inter = c.intermediate_size;
  const int64_t experts = c.num_experts;
  const int64_t shared = c.shared_expert_intermediate_size;
  const bool dense = !c.IsMixtureOfExperts();
  const struct {
    const HostTensor& tensor;
    int64_t elements;
    std::string_view name;
    bool projection = false;  // may be FP8
  } expected[] = {
      {w.input_layernorm, hidden, "input_layernorm"},
      {w.q_proj, q_dim * hidden, "q_proj", true},
      {w.k_proj, kv_dim * hidden, "k_proj", true},
      {w.v_proj, kv_dim * hidden, "v_proj", true},
      {w.q_bias, c.attention_bias ? q_dim : 0, "q_bias"},
      {w.k_bias, c.attention_bias ? kv_dim : 0, "k_bias"},
      {w.v_bias, c.attention_bias ? kv_dim : 0, "v_bias"},
      {w.q_norm, c.qk_norm ? c.head_dim : 0, "q_norm"},
      {w.k_norm, c.qk_norm ? c.head_dim : 0, "k_norm"},
      {w.o_proj, hidden * q_dim, "o_proj", true},
      {w.post_attention_layernorm, hidden, "post_attention_layernorm"},
      {w.gate_proj, dense ? inter * hidden : 0, "gate_proj", true},
      {w.up_proj, dense ? inter * hidden : 0, "up_proj", true},
      {w.down_proj, dense ? hidden * inter : 0, "down_proj", true},
      {w.router, experts * hidden, "router"},
      {w.experts_gate_up, experts * 2 * inter * hidden, "experts_gate_up", true},
      {w.experts_down, experts * hidden * inter, "experts_down", true},
      {w.shared_gate_proj, shared * hidden, "shared_gate_proj", true},
      {w.shared_up_proj, shared * hidden, "shared_up_proj", true},
      {w.shared_down_proj, hidden * shared, "shared_down_proj", true},
      {w.shared_expert_gate, c.HasSharedExpert() ? hidden : 0, "shared_expert_gate", true},
  };
  for (const auto& e : expected) {
    LS_RETURN_IF_ERROR(CheckElements(e.tensor, e.elements, layer, e.name));
    LS_RETURN_IF_ERROR(CheckFp8(e.tensor, e.projection, layer, e.name));
  }
  // Projections that read one input are computed as one (q, k and v; gate
  // and up), so they must agree on FP8 and on a static activation scale.
  const auto agree = [&](std::initializer_list<const HostTensor*> parts,
                         std::string_view what) -> absl::Status {
    for (const HostTensor* t : parts) {
      const HostTensor& first = **parts.begin();
      if ((t->dtype == DType::kF8E4M3) != (first.dtype == DType::kF8E4M3) ||
          t->input_scale != first.input_scale) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", layer, " ", ToAbsl(what),
            " differ in quantization (FP8 or not, or their static input_scale): not supported"));
      }
    }
    return absl::OkStatus();
  };
  LS_RETURN_IF_ERROR(agree({&w.q_proj, &w.k_proj, &w.v_proj}, "q_proj, k_proj and v_proj"));
  if (dense) LS_RETURN_IF_ERROR(agree({&w.gate_proj, &w.up_proj}, "gate_proj and up_proj"));
  if (c.HasSharedExpert()) {
    LS_RETURN_IF_ERROR(agree({&w.shared_gate_proj, &w.shared_up_proj},
                             "the shared expert's gate_proj and up_proj"));
    // Its one-row sigmoid gate reads the same input: FP8 only beside an FP8
    // gate/up, whose quantized input it then reads too. BF16 beside either,
    // reading the input unquantized: FP8 checkpoints leave that one row
    // unconverted (modules_to_not_convert).
    if (w.shared_expert_gate.dtype == DType::kF8E4M3) {
      LS_RETURN_IF_ERROR(
          agree({&w.shared_gate_proj, &w.shared_up_proj, &w.shared_expert_gate},
                "the shared expert's gate_proj, up_proj and an FP8 shared_expert_gate"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<LlamaConfig> ReadModelConfig(const std::filesystem::path& dir,
                                            const LayerRange& range) {
  const std::filesystem::path config_path = dir / "config.json";
  LS_ASSIGN_OR_RETURN(const std::string config_text, ReadTextFile(config_path));
  LS_ASSIGN_OR_RETURN(LlamaConfig config, ParseLlamaConfig(config_text, config_path.string()));
  const int64_t begin = range.begin.value_or(0);
  const int64_t end = range.end.value_or(config.num_hidden_layers);
  if (begin < 0 || end > config.num_hidden_layers || begin >= end) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer range [", begin, ", ", end, ") is empty or outside the ",
                     config.num_hidden_layers, " layers of ", config_path.string()));
  }
  return config;
}

absl::StatusOr<ModelSpan> LoadModelSpan(const std::filesystem::path& dir, const LayerRange& range,
                                        std::string model_name) {
  LS_ASSIGN_OR_RETURN(LlamaConfig config, ReadModelConfig(dir, range));
  const int64_t begin = range.begin.value_or(0);
  const int64_t end = range.end.value_or(config.num_hidden_layers);

  LS_ASSIGN_OR_RETURN(CheckpointFiles files, CheckpointFiles::Open(dir));
  files.fp8 = config.fp8;
  ModelSpan span;
  span.name = std::move(model_name);
  span.first_layer = begin;
  span.layers.reserve(static_cast<size_t>(end - begin));
  for (int64_t layer = begin; layer < end; ++layer) {
    LS_ASSIGN_OR_RETURN(LayerWeights weights, LoadLayer(files, config, layer));
    span.layers.push_back(std::move(weights));
  }
  span.config = std::move(config);
  return span;
}

}  // namespace layerserve
