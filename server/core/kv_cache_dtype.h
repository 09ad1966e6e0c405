// What the KV cache stores keys and values as (--kv-cache-dtype): the
// backend's activation dtype (float32 on the CPU, bf16 or fp16 on CUDA), or
// float8_e4m3fn codes with one float32 scale per token and KV head.
//
// The FP8 cache's numerics, the same on every backend: a token's K (or V)
// row of one KV head, x[0..head_dim), is stored as s = amax(|x|) / 448 and
// the codes e4m3(x / s) (round to nearest even, saturating; s = 0 stores zero
// codes), and read back as code * s. Every key and value a session step
// attends over is read back this way, its own new ones included, so a
// session's answers differ from a stateless request's by the cache's
// rounding (at most 2^-4 of a head's largest element; docs/sessions.md gives
// the measured error). Stateless requests never touch the cache. Design
// record 0017.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"

namespace layerserve {

enum class KvCacheDType {
  kActivation,  // the backend's activation dtype (--kv-cache-dtype=auto)
  kFp8E4M3,     // e4m3 codes and a float32 scale per token and KV head
};

// "auto" -> kActivation; "fp8" or "fp8_e4m3" (vLLM's spellings) -> kFp8E4M3;
// anything else INVALID_ARGUMENT naming the flag and the choices.
absl::StatusOr<KvCacheDType> ParseKvCacheDType(std::string_view value);

// "auto" or "fp8": what the start-up log and the flag say.
std::string_view KvCacheDTypeName(KvCacheDType dtype);

}  // namespace layerserve
