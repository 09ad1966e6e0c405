// config.json parsing (ParseLlamaConfig) and RoPE inverse frequencies
// (RopeInvFreq), declared in model.h.
//
// Field defaults follow Hugging Face's LlamaConfig / MistralConfig /
// Qwen2Config / MixtralConfig. Anything that would change a decoder layer's math in a way this
// server does not implement is rejected rather than ignored. Sliding-window
// attention is parsed into per-layer windows here (LlamaConfig::
// AttentionWindow), which both backends compute.
#include <algorithm>
#include <cmath>
#include <iterator>
#include <numbers>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/model/field_reader.h"
#include "server/model/fp8_config.h"
#include "server/model/model.h"

namespace layerserve {
namespace {

using nlohmann::json;

// `rope_scaling` (or the newer `rope_parameters`): null, {"rope_type":
// "default"} or llama3 scaling. Sets `config.rope_scaling` and, for
// rope_parameters, may carry rope_theta.
absl::Status ParseRopeScaling(const json& value, std::string_view key, std::string_view source,
                              LlamaConfig& config) {
  if (!value.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(source), ": field '", ToAbsl(key), "' must be an object or null"));
  }
  const FieldReader reader(value, source, absl::StrCat(ToAbsl(key), "."));
  LS_ASSIGN_OR_RETURN(std::optional<std::string> rope_type, reader.OptionalString("rope_type"));
  if (!rope_type) {
    LS_ASSIGN_OR_RETURN(rope_type, reader.OptionalString("type"));
  }
  LS_ASSIGN_OR_RETURN(std::optional<double> theta, reader.OptionalNumber("rope_theta"));
  if (theta) config.rope_theta = *theta;
  if (!rope_type || *rope_type == "default") {
    config.rope_scaling.reset();
    return absl::OkStatus();
  }
  if (*rope_type != "llama3") {
    return absl::UnimplementedError(
        absl::StrCat(ToAbsl(source), ": ", ToAbsl(key), " type '", *rope_type,
                     "' is not supported (supported: default, llama3)"));
  }
  Llama3RopeScaling scaling;
  LS_ASSIGN_OR_RETURN(scaling.factor, reader.RequiredNumber("factor"));
  LS_ASSIGN_OR_RETURN(scaling.low_freq_factor, reader.RequiredNumber("low_freq_factor"));
  LS_ASSIGN_OR_RETURN(scaling.high_freq_factor, reader.RequiredNumber("high_freq_factor"));
  LS_ASSIGN_OR_RETURN(scaling.original_max_position_embeddings,
                      reader.PositiveInt("original_max_position_embeddings"));
  if (!(scaling.factor > 0)) return reader.Error("factor", "must be positive");
  if (!(scaling.low_freq_factor > 0)) return reader.Error("low_freq_factor", "must be positive");
  if (!(scaling.high_freq_factor > scaling.low_freq_factor)) {
    return reader.Error("high_freq_factor", "must be greater than low_freq_factor");
  }
  config.rope_scaling = scaling;
  return absl::OkStatus();
}

// The window size and the windowed layers: see ParseLlamaConfig in model.h.
absl::Status ParseSlidingWindow(const json& root, const FieldReader& reader, LlamaConfig& config) {
  // Mirrors the transformers configs: MistralConfig defaults sliding_window to
  // 4096 (null disables it); Qwen2Config keeps it only with
  // use_sliding_window, and then windows layers >= max_window_layers; llama
  // has no window at all.
  std::optional<int64_t> window;
  const bool qwen = config.model_type == "qwen2" || config.model_type == "qwen2_moe" ||
                    config.model_type == "qwen3" || config.model_type == "qwen3_moe";
  if (config.model_type == "mistral" || qwen || config.model_type == "mixtral") {
    bool enabled = true;
    if (qwen) {
      LS_ASSIGN_OR_RETURN(std::optional<bool> use, reader.OptionalBool("use_sliding_window"));
      enabled = use.value_or(false);
    }
    if (enabled) {
      const auto it = root.find("sliding_window");
      if (it == root.end()) {
        // MixtralConfig's default is None, MistralConfig's 4096.
        if (config.model_type == "mistral") window = 4096;
      } else if (!it->is_null()) {
        LS_ASSIGN_OR_RETURN(window, reader.OptionalInt("sliding_window"));
        if (*window <= 0) {
          return reader.Error("sliding_window", absl::StrCat("must be positive, got ", *window));
        }
      }
    }
  }
  const int64_t layers = config.num_hidden_layers;
  if (const json* types = reader.Find("layer_types")) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != layers) {
      return reader.Error("layer_types", absl::StrCat("must be a list of num_hidden_layers (",
                                                      layers, ") strings"));
    }
    config.sliding_layers.assign(static_cast<size_t>(layers), false);
    for (int64_t i = 0; i < layers; ++i) {
      const json& t = (*types)[static_cast<size_t>(i)];
      if (t == "sliding_attention") {
        config.sliding_layers[static_cast<size_t>(i)] = true;
      } else if (t != "full_attention") {
        return absl::UnimplementedError(
            absl::StrCat(reader.Error("layer_types", "").message(), "entry ", i, " is ", t.dump(),
                         "; supported: \"full_attention\", \"sliding_attention\""));
      }
    }
  } else if (window && qwen) {
    LS_ASSIGN_OR_RETURN(std::optional<int64_t> max_window_layers,
                        reader.OptionalInt("max_window_layers"));
    const int64_t first_windowed = max_window_layers.value_or(28);
    config.sliding_layers.assign(static_cast<size_t>(layers), false);
    for (int64_t i = std::max<int64_t>(first_windowed, 0); i < layers; ++i) {
      config.sliding_layers[static_cast<size_t>(i)] = true;
    }
  }
  config.sliding_window = window.value_or(0);
  return absl::OkStatus();
}

// Mixtral's experts: how many, and how many each token uses. Everything else
// in its MoE block (softmax over all experts in float32, top-k, weights
// renormalised over the chosen experts) is fixed by the architecture.
absl::Status ParseExperts(const FieldReader& reader, LlamaConfig& config) {
  LS_ASSIGN_OR_RETURN(config.num_experts, reader.PositiveInt("num_local_experts"));
  LS_ASSIGN_OR_RETURN(std::optional<int64_t> top_k, reader.OptionalInt("num_experts_per_tok"));
  config.experts_per_token = top_k.value_or(2);  // MixtralConfig's default
  if (config.experts_per_token <= 0 || config.experts_per_token > config.num_experts) {
    return reader.Error(
        "num_experts_per_tok",
        absl::StrCat("(", config.experts_per_token, ") must be between 1 and num_local_experts (",
                     config.num_experts, ")"));
  }
  return absl::OkStatus();
}

// Qwen2-MoE's and Qwen3-MoE's experts (Qwen2MoeConfig, Qwen3MoeConfig):
// num_experts of moe_intermediate_size each, num_experts_per_tok per token
// (default 4 and 8), weights renormalised only with norm_topk_prob, and for
// Qwen2-MoE a shared expert. A layer is sparse when it is not in
// mlp_only_layers and (layer + 1) % decoder_sparse_step == 0; the backends
// hold one kind of MLP per span, so a model with dense layers is refused.
absl::Status ParseQwenMoeExperts(const FieldReader& reader, LlamaConfig& config) {
  const bool qwen3 = config.model_type == "qwen3_moe";
  // Published checkpoints name the count num_experts; transformers 5's
  // Qwen3MoeConfig maps that attribute onto num_local_experts, which is the
  // key its save_pretrained writes.
  const bool local = reader.Find("num_experts") == nullptr && reader.Find("num_local_experts");
  LS_ASSIGN_OR_RETURN(config.num_experts,
                      reader.PositiveInt(local ? "num_local_experts" : "num_experts"));
  LS_ASSIGN_OR_RETURN(std::optional<int64_t> top_k, reader.OptionalInt("num_experts_per_tok"));
  config.experts_per_token = top_k.value_or(qwen3 ? 8 : 4);
  if (config.experts_per_token <= 0 || config.experts_per_token > config.num_experts) {
    return reader.Error("num_experts_per_tok", absl::StrCat("(", config.experts_per_token,
                                                            ") must be between 1 and num_experts (",
                                                            config.num_experts, ")"));
  }
  LS_ASSIGN_OR_RETURN(config.intermediate_size, reader.PositiveInt("moe_intermediate_size"));
  if (!qwen3) {
    LS_ASSIGN_OR_RETURN(std::optional<int64_t> shared,
                        reader.OptionalInt("shared_expert_intermediate_size"));
    config.shared_expert_intermediate_size = shared.value_or(5632);  // Qwen2MoeConfig's default
  }
  if (config.shared_expert_intermediate_size < 0) {
    return reader.Error("shared_expert_intermediate_size", "must be >= 0");
  }
  LS_ASSIGN_OR_RETURN(std::optional<bool> norm, reader.OptionalBool("norm_topk_prob"));
  config.normalize_top_k = norm.value_or(false);
  LS_ASSIGN_OR_RETURN(std::optional<int64_t> step, reader.OptionalInt("decoder_sparse_step"));
  const json* dense = reader.Find("mlp_only_layers");
  const bool some_dense = dense != nullptr && !(dense->is_array() && dense->empty());
  if (step.value_or(1) != 1 || some_dense) {
    return absl::UnimplementedError(
        reader
            .Error("decoder_sparse_step",
                   absl::StrCat("(", step.value_or(1), ") and mlp_only_layers (",
                                dense != nullptr ? dense->dump() : "[]",
                                ") give some layers a dense MLP; only models whose every layer is "
                                "sparse are supported (decoder_sparse_step 1, no mlp_only_layers)"))
            .message());
  }
  return absl::OkStatus();
}

}  // namespace

int64_t LlamaConfig::AttentionWindow(int64_t layer) const {
  if (sliding_window <= 0) return 0;
  if (sliding_layers.empty()) return sliding_window;
  if (layer < 0 || layer >= static_cast<int64_t>(sliding_layers.size())) return 0;
  return sliding_layers[static_cast<size_t>(layer)] ? sliding_window : 0;
}

int64_t LlamaConfig::SmallestAttentionWindow(int64_t first, int64_t count) const {
  int64_t smallest = 0;
  for (int64_t layer = first; layer < first + count; ++layer) {
    const int64_t w = AttentionWindow(layer);
    if (w > 0 && (smallest == 0 || w < smallest)) smallest = w;
  }
  return smallest;
}

absl::StatusOr<LlamaConfig> ParseLlamaConfig(std::string_view json_text, std::string_view source) {
  const json root = json::parse(json_text, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(ToAbsl(source), ": not valid JSON"));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(ToAbsl(source), ": not a JSON object"));
  }
  const FieldReader reader(root, source);
  LlamaConfig config;

  LS_ASSIGN_OR_RETURN(std::optional<std::string> model_type, reader.OptionalString("model_type"));
  if (!model_type) return reader.Error("model_type", "is missing");
  static constexpr std::string_view kTypes[] = {"llama",   "mistral",   "qwen2",    "qwen3",
                                                "mixtral", "qwen2_moe", "qwen3_moe"};
  if (std::find(std::begin(kTypes), std::end(kTypes), *model_type) == std::end(kTypes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(source), ": model_type '", *model_type,
                     "' is not supported (llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, "
                     "qwen3_moe)"));
  }
  config.model_type = *model_type;

  LS_ASSIGN_OR_RETURN(config.hidden_size, reader.PositiveInt("hidden_size"));
  LS_ASSIGN_OR_RETURN(config.intermediate_size, reader.PositiveInt("intermediate_size"));
  LS_ASSIGN_OR_RETURN(config.num_attention_heads, reader.PositiveInt("num_attention_heads"));
  LS_ASSIGN_OR_RETURN(config.num_hidden_layers, reader.PositiveInt("num_hidden_layers"));

  LS_ASSIGN_OR_RETURN(std::optional<int64_t> kv_heads, reader.OptionalInt("num_key_value_heads"));
  config.num_key_value_heads = kv_heads.value_or(config.num_attention_heads);
  if (config.num_key_value_heads <= 0 ||
      config.num_attention_heads % config.num_key_value_heads != 0) {
    return reader.Error("num_key_value_heads",
                        absl::StrCat("(", config.num_key_value_heads,
                                     ") must be positive and divide num_attention_heads (",
                                     config.num_attention_heads, ")"));
  }

  LS_ASSIGN_OR_RETURN(std::optional<int64_t> head_dim, reader.OptionalInt("head_dim"));
  if (head_dim) {
    config.head_dim = *head_dim;
  } else {
    if (config.hidden_size % config.num_attention_heads != 0) {
      return reader.Error(
          "hidden_size",
          absl::StrCat("(", config.hidden_size, ") is not divisible by num_attention_heads (",
                       config.num_attention_heads, ") and head_dim is not set"));
    }
    config.head_dim = config.hidden_size / config.num_attention_heads;
  }
  if (config.head_dim <= 0 || config.head_dim % 2 != 0) {
    return reader.Error("head_dim",
                        absl::StrCat("(", config.head_dim, ") must be positive and even"));
  }

  LS_ASSIGN_OR_RETURN(std::optional<double> eps, reader.OptionalNumber("rms_norm_eps"));
  if (eps) config.rms_norm_eps = *eps;
  if (!(config.rms_norm_eps > 0)) return reader.Error("rms_norm_eps", "must be positive");
  LS_ASSIGN_OR_RETURN(std::optional<double> theta, reader.OptionalNumber("rope_theta"));
  if (theta) config.rope_theta = *theta;

  if (const json* v = reader.Find("rope_scaling")) {
    LS_RETURN_IF_ERROR(ParseRopeScaling(*v, "rope_scaling", source, config));
  } else if (const json* p = reader.Find("rope_parameters")) {
    LS_RETURN_IF_ERROR(ParseRopeScaling(*p, "rope_parameters", source, config));
  }
  if (!(config.rope_theta > 0)) return reader.Error("rope_theta", "must be positive");

  LS_ASSIGN_OR_RETURN(std::optional<std::string> act, reader.OptionalString("hidden_act"));
  if (act && *act != "silu") {
    return absl::UnimplementedError(
        absl::StrCat(ToAbsl(source), ": hidden_act '", *act, "' is not supported (silu)"));
  }
  LS_ASSIGN_OR_RETURN(std::optional<bool> mlp_bias, reader.OptionalBool("mlp_bias"));
  if (mlp_bias.value_or(false)) {
    return absl::UnimplementedError(
        absl::StrCat(ToAbsl(source), ": mlp_bias=true is not supported"));
  }
  LS_ASSIGN_OR_RETURN(std::optional<bool> attention_bias, reader.OptionalBool("attention_bias"));
  if (config.model_type == "qwen2") {
    config.attention_bias = true;  // Qwen2Attention: q/k/v biased, o_proj not
  } else if (config.model_type == "qwen2_moe") {
    // Qwen2MoeAttention: q/k/v biased by qkv_bias (default true), o_proj not.
    LS_ASSIGN_OR_RETURN(std::optional<bool> qkv_bias, reader.OptionalBool("qkv_bias"));
    config.attention_bias = qkv_bias.value_or(true);
  } else if (config.model_type == "qwen3" || config.model_type == "qwen3_moe") {
    config.qk_norm = true;  // Qwen3Attention: q_norm and k_norm over each head
  }
  if ((config.model_type == "llama" || config.model_type == "qwen3" ||
       config.model_type == "qwen3_moe") &&
      attention_bias.value_or(false)) {
    // LlamaAttention's attention_bias (and Qwen3Attention's) also gives o_proj
    // a bias, which LayerWeights has no slot for; serving without it would be
    // silently wrong.
    return absl::UnimplementedError(absl::StrCat(
        ToAbsl(source), ": attention_bias=true (q/k/v/o_proj biases) is not supported"));
  }

  if (config.model_type == "mixtral") {
    LS_RETURN_IF_ERROR(ParseExperts(reader, config));
  } else if (config.model_type == "qwen2_moe" || config.model_type == "qwen3_moe") {
    LS_RETURN_IF_ERROR(ParseQwenMoeExperts(reader, config));
  }

  LS_ASSIGN_OR_RETURN(std::optional<std::string> torch_dtype, reader.OptionalString("torch_dtype"));
  if (!torch_dtype) {
    LS_ASSIGN_OR_RETURN(torch_dtype, reader.OptionalString("dtype"));
  }
  config.torch_dtype = torch_dtype.value_or("");
  LS_RETURN_IF_ERROR(ParseSlidingWindow(root, reader, config));
  LS_ASSIGN_OR_RETURN(config.fp8, ParseFp8Quantization(root, source));
  return config;
}

// Mirrors transformers' _compute_default_rope_parameters and
// _compute_llama3_parameters step by step in float32, including where torch
// evaluates `scalar / tensor` as reciprocal(tensor) * scalar, so the
// frequencies match Hugging Face's to the last bit on typical inputs.
std::vector<float> RopeInvFreq(const LlamaConfig& config) {
  const int64_t dim = config.head_dim;
  const float base = static_cast<float>(config.rope_theta);
  std::vector<float> inv_freq(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    inv_freq[i] = 1.0f / std::pow(base, exponent);
  }
  if (!config.rope_scaling) return inv_freq;

  const Llama3RopeScaling& s = *config.rope_scaling;
  const float factor = static_cast<float>(s.factor);
  const double old_context_len = static_cast<double>(s.original_max_position_embeddings);
  const float low_freq_wavelen = static_cast<float>(old_context_len / s.low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(old_context_len / s.high_freq_factor);
  const float two_pi = static_cast<float>(2 * std::numbers::pi);
  const float low = static_cast<float>(s.low_freq_factor);
  const float span = static_cast<float>(s.high_freq_factor - s.low_freq_factor);
  for (float& f : inv_freq) {
    const float wavelen = (1.0f / f) * two_pi;
    float scaled = wavelen > low_freq_wavelen ? f / factor : f;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    if (medium) {
      const float smooth = ((1.0f / wavelen) * static_cast<float>(old_context_len) - low) / span;
      scaled = (1.0f - smooth) * scaled / factor + smooth * scaled;
    }
    f = scaled;
  }
  return inv_freq;
}

std::string DescribeRope(const LlamaConfig& config) {
  // %.10g: 1000000 (Qwen2's theta) reads as such, not as 1e+06.
  std::string text = absl::StrFormat("rope theta %.10g, ", config.rope_theta);
  if (!config.rope_scaling) return text + "no scaling";
  const Llama3RopeScaling& s = *config.rope_scaling;
  return text + absl::StrFormat(
                    "llama3 scaling (factor %.10g, low_freq_factor %.10g, high_freq_factor %.10g, "
                    "original_max_position_embeddings %d)",
                    s.factor, s.low_freq_factor, s.high_freq_factor,
                    s.original_max_position_embeddings);
}

}  // namespace layerserve
