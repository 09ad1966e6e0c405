// What the edge needs to know about the one model this process serves.
#pragma once

#include <cstdint>
#include <string>

#include "server/core/kv_cache_dtype.h"
#include "server/model/model.h"

namespace layerserve {

struct ServedModel {
  std::string name;
  std::string version = "1";
  LlamaConfig config;
  int64_t first_layer = 0;
  int64_t num_layers = 0;
  std::string backend;           // "cpu" or "cuda"
  int64_t max_batch_tokens = 0;  // also the per-request token limit
  int64_t max_queue_delay_us = 0;
  int64_t max_queue_size = 0;
  // Sessions (docs/sessions.md): served when the backend keeps a KV cache.
  bool sessions = false;
  // Without sessions: why, for the error a session request gets ("the cuda
  // backend keeps no KV cache yet", "--kv-cache-memory=0").
  std::string sessions_off_reason;
  int64_t kv_block_tokens = 0;                              // tokens per KV cache block
  int64_t kv_blocks = 0;                                    // blocks in the pool
  KvCacheDType kv_cache_dtype = KvCacheDType::kActivation;  // advertised as "auto" or "fp8"
  int64_t max_sessions = 0;
  int64_t max_session_tokens = 0;       // 0: no limit beyond the pool
  int64_t session_idle_timeout_us = 0;  // 0: sessions never expire
};

}  // namespace layerserve
