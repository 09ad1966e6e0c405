// layerserve's command line: every flag with its default (README.md's flag
// table), parsed with CLI11, and the checks of their values. Only main.cc
// uses it; it is a file of its own to keep main.cc to the wiring.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace layerserve {

// Every command-line flag, with its default (README.md's flag table).
// Filled once by ParseCommandLine, then only read.
struct ServerFlags {
  std::string model_dir;
  std::string model_name;
  std::string layers = ":";
  std::string host = "0.0.0.0";
  int grpc_port = 8001;
  int metrics_port = 8002;
  std::string backend = "auto";
  int64_t max_batch_tokens = 8192;
  int64_t max_queue_delay_us = 500;
  int64_t max_queue_size = 1024;
  int64_t max_queue_bytes = 0;  // 0: DefaultMaxQueueBytes
  int cpu_threads = 0;
  int drain_timeout_s = 30;
  int64_t grpc_max_connection_age_s = 0;  // 0: connections live as long as clients keep them
  // The CUDA backend's flags. A CPU-only build accepts and ignores them, so
  // one command line serves both builds.
  int streams = 2;
  int cuda_device = 0;
  std::string gemm = "auto";
  bool gemm_autotune = true;
  std::string gemm_tune_cache;
  std::string gemm_override;
};

// Fills `flags` from the command line. nullopt: serve; otherwise the exit
// status main() returns (0 after --help or --version, 1 for an unknown flag
// or a value of the wrong type, with one line on stderr).
std::optional<int> ParseCommandLine(int argc, char** argv, std::string_view version,
                                    ServerFlags& flags);

// INVALID_ARGUMENT naming the first flag whose value is out of range.
absl::Status CheckFlags(const ServerFlags& flags);

}  // namespace layerserve
