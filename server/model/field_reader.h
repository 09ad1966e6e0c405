// FieldReader: typed fields out of one config.json object, with errors that
// name the file and the field. Shared by the parsers of server/model
// (model_config.cc, fp8_config.cc); not part of the target's interface.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace layerserve {

// Reads typed fields out of one JSON object, with errors that name the file
// and the field.
class FieldReader {
 public:
  FieldReader(const nlohmann::json& object, std::string_view source, std::string prefix = "")
      : object_(object), source_(source), prefix_(std::move(prefix)) {}

  // Absent and null both mean "not set", as in Hugging Face configs.
  const nlohmann::json* Find(std::string_view key) const {
    const auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::Status Error(std::string_view key, std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(source_), ": field '", prefix_, ToAbsl(key), "' ", ToAbsl(what)));
  }

  absl::StatusOr<std::optional<int64_t>> OptionalInt(std::string_view key) const {
    const nlohmann::json* v = Find(key);
    if (v == nullptr) return std::optional<int64_t>();
    if (!v->is_number_integer()) return Error(key, "must be an integer");
    return std::optional<int64_t>(v->get<int64_t>());
  }

  absl::StatusOr<int64_t> PositiveInt(std::string_view key) const {
    LS_ASSIGN_OR_RETURN(std::optional<int64_t> v, OptionalInt(key));
    if (!v) return Error(key, "is missing");
    if (*v <= 0) return Error(key, absl::StrCat("must be positive, got ", *v));
    return *v;
  }

  absl::StatusOr<std::optional<double>> OptionalNumber(std::string_view key) const {
    const nlohmann::json* v = Find(key);
    if (v == nullptr) return std::optional<double>();
    if (!v->is_number()) return Error(key, "must be a number");
    return std::optional<double>(v->get<double>());
  }

  absl::StatusOr<double> RequiredNumber(std::string_view key) const {
    LS_ASSIGN_OR_RETURN(std::optional<double> v, OptionalNumber(key));
    if (!v) return Error(key, "is missing");
    return *v;
  }

  absl::StatusOr<std::optional<bool>> OptionalBool(std::string_view key) const {
    const nlohmann::json* v = Find(key);
    if (v == nullptr) return std::optional<bool>();
    if (!v->is_boolean()) return Error(key, "must be true or false");
    return std::optional<bool>(v->get<bool>());
  }

  absl::StatusOr<std::optional<std::string>> OptionalString(std::string_view key) const {
    const nlohmann::json* v = Find(key);
    if (v == nullptr) return std::optional<std::string>();
    if (!v->is_string()) return Error(key, "must be a string");
    return std::optional<std::string>(v->get<std::string>());
  }

 private:
  const nlohmann::json& object_;
  std::string_view source_;
  std::string prefix_;
};

}  // namespace layerserve
