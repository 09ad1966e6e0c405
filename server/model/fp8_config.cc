// quantization_config -> Fp8Quantization (see fp8_config.h).
//
// transformers' fine-grained FP8 (FineGrainedFP8Config, as saved):
//   {"quant_method": "fp8", "activation_scheme": "dynamic",
//    "weight_block_size": [128, 128], "modules_to_not_convert": [...]}
// compressed-tensors (llm-compressor's FP8_DYNAMIC, FP8, FP8_BLOCK, FP8 weight-only):
//   {"quant_method": "compressed-tensors", "format": "float-quantized",
//    "config_groups": {"group_0": {"targets": ["Linear"],
//        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"|"tensor"|"block",
//                    "block_structure": [128, 128], ...},
//        "input_activations": {"num_bits": 8, "type": "float",
//                              "strategy": "token"|"tensor"|"group", "dynamic": true|false,
//                              "group_size": 128} | null}},
//    "ignore": ["lm_head", ...], "kv_cache_scheme": null}
// Which linears are quantized is what the checkpoint stores (an FP8 weight
// with its scales, or a BF16 one for an ignored module), so the module lists
// are not needed to load it.
#include "server/model/fp8_config.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "server/model/field_reader.h"

namespace layerserve {
namespace {

using nlohmann::json;

absl::Status Unsupported(std::string_view source, std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(ToAbsl(source), ": quantization_config.", ToAbsl(field), " ", ToAbsl(what)));
}

// A [rows, cols] pair of positive integers (weight_block_size,
// block_structure).
absl::StatusOr<std::pair<int64_t, int64_t>> BlockShape(const json* value, std::string_view source,
                                                       std::string_view field) {
  if (value == nullptr || !value->is_array() || value->size() != 2 ||
      !(*value)[0].is_number_integer() || !(*value)[1].is_number_integer() ||
      (*value)[0].get<int64_t>() <= 0 || (*value)[1].get<int64_t>() <= 0) {
    return Unsupported(source, field, "must be a pair of positive integers [rows, cols]");
  }
  return std::make_pair((*value)[0].get<int64_t>(), (*value)[1].get<int64_t>());
}

absl::StatusOr<Fp8Quantization> FineGrained(const json& q, std::string_view source) {
  const FieldReader reader(q, source, "quantization_config.");
  Fp8Quantization fp8;
  fp8.format = Fp8Quantization::Format::kFineGrained;
  LS_ASSIGN_OR_RETURN(std::optional<std::string> scheme,
                      reader.OptionalString("activation_scheme"));
  if (scheme.value_or("dynamic") != "dynamic") {
    return Unsupported(source, "activation_scheme",
                       absl::StrCat("'", *scheme, "' is not supported (dynamic)"));
  }
  LS_ASSIGN_OR_RETURN(std::optional<bool> dequantize, reader.OptionalBool("dequantize"));
  if (dequantize.value_or(false)) {
    return Unsupported(source, "dequantize", "true (a BF16 checkpoint) is not an FP8 checkpoint");
  }
  LS_ASSIGN_OR_RETURN(std::optional<std::string> scale_fmt, reader.OptionalString("scale_fmt"));
  if (scale_fmt.value_or("float") != "float") {
    return Unsupported(source, "scale_fmt",
                       absl::StrCat("'", *scale_fmt, "' is not supported (float32 scales)"));
  }
  if (reader.Find("weight_block_size") == nullptr) {
    return Unsupported(source, "weight_block_size",
                       "is missing: per-tensor fine-grained FP8 is not supported (block scales)");
  }
  LS_ASSIGN_OR_RETURN(const auto block,
                      BlockShape(reader.Find("weight_block_size"), source, "weight_block_size"));
  fp8.weight_block_rows = block.first;
  fp8.weight_block_cols = block.second;
  // Each token's activations are quantized per group of the weight block's
  // width, so that a K block of the product has one scale on either side.
  fp8.activations = Fp8Quantization::Activations::kPerTokenGroup;
  fp8.activation_group = block.second;
  return fp8;
}

// An FP8 argument ({num_bits: 8, type: "float"}) of a compressed-tensors
// config group, else the error naming `field`.
absl::Status CheckFloat8(const json& args, std::string_view source, const std::string& field) {
  const FieldReader reader(args, source, "quantization_config." + field + ".");
  LS_ASSIGN_OR_RETURN(std::optional<int64_t> bits, reader.OptionalInt("num_bits"));
  LS_ASSIGN_OR_RETURN(std::optional<std::string> type, reader.OptionalString("type"));
  if (bits.value_or(0) != 8 || type.value_or("") != "float") {
    return Unsupported(
        source, field,
        absl::StrCat("is ", bits ? absl::StrCat(*bits, "-bit ") : "", type.value_or("untyped"),
                     ": only 8-bit float (FP8 e4m3) is supported"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Fp8Quantization> CompressedTensors(const json& q, std::string_view source) {
  const FieldReader reader(q, source, "quantization_config.");
  Fp8Quantization fp8;
  fp8.format = Fp8Quantization::Format::kCompressedTensors;
  LS_ASSIGN_OR_RETURN(std::optional<std::string> format, reader.OptionalString("format"));
  if (format.value_or("") != "float-quantized") {
    return Unsupported(source, "format",
                       absl::StrCat("'", format.value_or(""),
                                    "' is not supported (float-quantized: FP8 weights)"));
  }
  if (reader.Find("kv_cache_scheme") != nullptr) {
    return Unsupported(source, "kv_cache_scheme", "is set: a quantized KV cache is not supported");
  }
  const json* groups = reader.Find("config_groups");
  if (groups == nullptr || !groups->is_object() || groups->size() != 1) {
    return Unsupported(source, "config_groups",
                       "must hold exactly one group (one scheme for every quantized linear)");
  }
  const std::string group_name = groups->begin().key();
  const json& group = groups->begin().value();
  if (!group.is_object())
    return Unsupported(source, "config_groups." + group_name, "is not an object");
  const std::string prefix = "config_groups." + group_name;
  const FieldReader g(group, source, "quantization_config." + prefix + ".");
  if (g.Find("output_activations") != nullptr) {
    return Unsupported(source, prefix + ".output_activations", "is set: not supported");
  }
  const json* weights = g.Find("weights");
  if (weights == nullptr || !weights->is_object()) {
    return Unsupported(source, prefix + ".weights", "is missing");
  }
  LS_RETURN_IF_ERROR(CheckFloat8(*weights, source, prefix + ".weights"));
  const FieldReader w(*weights, source, "quantization_config." + prefix + ".weights.");
  LS_ASSIGN_OR_RETURN(std::optional<std::string> strategy, w.OptionalString("strategy"));
  LS_ASSIGN_OR_RETURN(std::optional<bool> w_dynamic, w.OptionalBool("dynamic"));
  if (w_dynamic.value_or(false)) {
    return Unsupported(source, prefix + ".weights.dynamic", "true is not supported");
  }
  if (strategy == "channel") {
    fp8.weight_block_rows = 1;
    fp8.weight_block_cols = 0;
  } else if (strategy == "tensor") {
    fp8.weight_block_rows = 0;
    fp8.weight_block_cols = 0;
  } else if (strategy == "block") {
    LS_ASSIGN_OR_RETURN(const auto block, BlockShape(w.Find("block_structure"), source,
                                                     prefix + ".weights.block_structure"));
    fp8.weight_block_rows = block.first;
    fp8.weight_block_cols = block.second;
  } else {
    return Unsupported(
        source, prefix + ".weights.strategy",
        absl::StrCat("'", strategy.value_or(""), "' is not supported (channel, tensor or block)"));
  }

  const json* inputs = g.Find("input_activations");
  if (inputs == nullptr) {
    fp8.activations = Fp8Quantization::Activations::kNone;  // weight-only FP8
    return fp8;
  }
  if (!inputs->is_object())
    return Unsupported(source, prefix + ".input_activations", "is not an object");
  LS_RETURN_IF_ERROR(CheckFloat8(*inputs, source, prefix + ".input_activations"));
  const FieldReader a(*inputs, source, "quantization_config." + prefix + ".input_activations.");
  LS_ASSIGN_OR_RETURN(std::optional<std::string> a_strategy, a.OptionalString("strategy"));
  LS_ASSIGN_OR_RETURN(std::optional<bool> dynamic, a.OptionalBool("dynamic"));
  if (a_strategy == "token" && dynamic.value_or(false)) {
    fp8.activations = Fp8Quantization::Activations::kPerToken;
  } else if (a_strategy == "tensor" && !dynamic.value_or(false)) {
    fp8.activations = Fp8Quantization::Activations::kStaticPerTensor;
  } else if (a_strategy == "group" && dynamic.value_or(false)) {
    LS_ASSIGN_OR_RETURN(std::optional<int64_t> group_size, a.OptionalInt("group_size"));
    if (group_size.value_or(0) <= 0) {
      return Unsupported(source, prefix + ".input_activations.group_size", "must be positive");
    }
    fp8.activations = Fp8Quantization::Activations::kPerTokenGroup;
    fp8.activation_group = *group_size;
  } else {
    return Unsupported(
        source, prefix + ".input_activations",
        absl::StrCat("strategy '", a_strategy.value_or(""), "' with dynamic ",
                     dynamic.value_or(false) ? "true" : "false",
                     " is not supported (token dynamic, group dynamic, or tensor static)"));
  }
  return fp8;
}

}  // namespace

absl::StatusOr<std::optional<Fp8Quantization>> ParseFp8Quantization(const json& root,
                                                                    std::string_view source) {
  const auto it = root.find("quantization_config");
  if (it == root.end() || it->is_null()) return std::optional<Fp8Quantization>();
  if (!it->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(source), ": field 'quantization_config' must be an object or null"));
  }
  const FieldReader reader(*it, source, "quantization_config.");
  LS_ASSIGN_OR_RETURN(std::optional<std::string> method, reader.OptionalString("quant_method"));
  if (method == "fp8" || method == "compressed-tensors") {
    LS_ASSIGN_OR_RETURN(Fp8Quantization fp8, method == "fp8" ? FineGrained(*it, source)
                                                             : CompressedTensors(*it, source));
    return std::optional<Fp8Quantization>(std::move(fp8));
  }
  return Unsupported(source, "quant_method",
                     absl::StrCat("'", method.value_or(""),
                                  "' is not supported (fp8: transformers' fine-grained FP8; "
                                  "compressed-tensors: float-quantized FP8)"));
}

std::string Fp8Quantization::Describe() const {
  const std::string format_name = format == Format::kFineGrained
                                      ? "transformers fine-grained"
                                      : "compressed-tensors float-quantized";
  std::string weights;
  if (weight_block_rows == 0 && weight_block_cols == 0) {
    weights = "one weight scale per tensor";
  } else if (weight_block_rows == 1 && weight_block_cols == 0) {
    weights = "one weight scale per output channel";
  } else {
    weights = absl::StrCat(weight_block_rows, "x", weight_block_cols, " weight blocks");
  }
  std::string inputs;
  switch (activations) {
    case Activations::kPerTokenGroup:
      inputs = absl::StrCat("activations per token and ", activation_group, " channels, dynamic");
      break;
    case Activations::kPerToken:
      inputs = "activations per token, dynamic";
      break;
    case Activations::kStaticPerTensor:
      inputs = "activations per tensor, static input_scale";
      break;
    case Activations::kNone:
      inputs = "activations unquantized (weight-only)";
      break;
  }
  return absl::StrCat("fp8 (", format_name, ": ", weights, ", ", inputs, ")");
}

}  // namespace layerserve
