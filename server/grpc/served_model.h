// What the edge needs to know about the one model this process serves.
#pragma once

#include <cstdint>
#include <string>

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
  // Backend::MaxSequence(): the longest sequence served (0: no limit) and why.
  int64_t max_sequence_tokens = 0;
  std::string sequence_limit_reason;
};

}  // namespace layerserve
