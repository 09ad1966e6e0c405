// --kv-cache-dtype's values (see kv_cache_dtype.h).
#include "server/core/kv_cache_dtype.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace layerserve {

absl::StatusOr<KvCacheDType> ParseKvCacheDType(std::string_view value) {
  if (value == "auto") return KvCacheDType::kActivation;
  if (value == "fp8" || value == "fp8_e4m3") return KvCacheDType::kFp8E4M3;
  return absl::InvalidArgumentError(
      absl::StrCat("--kv-cache-dtype=", std::string(value), " is not one of auto, fp8, fp8_e4m3"));
}

std::string_view KvCacheDTypeName(KvCacheDType dtype) {
  return dtype == KvCacheDType::kFp8E4M3 ? "fp8" : "auto";
}

}  // namespace layerserve
