// Parses config.json's quantization_config into Fp8Quantization (model.h):
// transformers' fine-grained FP8 and compressed-tensors' float-quantized
// FP8. Internal to server/model (ParseLlamaConfig calls it).
#pragma once

#include <optional>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "server/model/model.h"

namespace layerserve {

// `root` is the whole config.json object. No quantization_config (or null):
// nullopt. A quantization method, scheme or layout the server does not
// compute exactly as its format defines is INVALID_ARGUMENT, one line
// naming the file, the field and what is supported: never a silent
// fallback that changes the numerics.
absl::StatusOr<std::optional<Fp8Quantization>> ParseFp8Quantization(const nlohmann::json& root,
                                                                    std::string_view source);

}  // namespace layerserve
