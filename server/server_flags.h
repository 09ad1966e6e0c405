// layerserve's command line: every flag with its default (docs/flags.md's
// table), parsed with CLI11, and the checks of their values. Only main.cc
// uses it; it is a file of its own to keep main.cc to the wiring.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/core/kv_cache_dtype.h"

namespace layerserve {

// Every command-line flag, with its default (docs/flags.md's table).
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
  bool batch_delay_when_idle = false;  // BatchPolicy::delay_when_idle
  int64_t max_device_wait_us = 2000;   // BatchPolicy::max_device_wait (0: off)
  int64_t device_lead_us = 100;        // BatchPolicy::device_lead
  int64_t max_queue_size = 1024;
  int64_t max_queue_bytes = 0;  // 0: DefaultMaxQueueBytes
  int cpu_threads = 0;
  int drain_timeout_s = 30;
  int drain_sessions_timeout_s = 30;           // before drain_timeout_s: open sessions' time to end
  int64_t grpc_max_connection_age_s = 0;       // 0: connections live as long as clients keep them
  int64_t grpc_max_connection_idle_s = 300;    // GrpcFrontendOptions::max_connection_idle_s
  int64_t grpc_max_concurrent_streams = 1024;  // GrpcFrontendOptions::max_concurrent_streams
  int grpc_threads = 0;                        // GrpcFrontendOptions::queue_threads
  int reply_threads = 4;                       // BatcherOptions::reply_threads
  std::string log_format = "text";             // base/log.h's ParseLogFormat
  // Sessions (docs/sessions.md).
  std::string kv_cache_memory = "auto";  // see KvCacheBytes
  int64_t kv_block_tokens = 16;
  std::string kv_cache_dtype = "auto";  // server/core/kv_cache_dtype.h's ParseKvCacheDType
  int64_t max_sessions = 1024;
  int64_t max_session_tokens = 0;  // 0: no limit beyond the pool
  int64_t session_idle_timeout_s = 300;
  int64_t prefill_chunk_tokens = 2048;
  // The CUDA backend's flags. A CPU-only build accepts and ignores them, so
  // one command line serves both builds.
  int streams = 2;
  int cuda_device = 0;
  int64_t cuda_graph_max_tokens = 256;
  bool cuda_warmup = true;
  std::string cuda_wait = "spin";  // CudaBackendOptions::blocking_wait: spin or block
  std::string gemm = "auto";
  bool gemm_autotune = true;
  std::string gemm_tune_cache;
  std::string gemm_override;
  // Security (docs/security.md); server_security.h loads and checks them.
  std::string tls_cert_file;       // set: the gRPC port speaks TLS only
  std::string tls_key_file;        // its key
  std::string tls_client_ca_file;  // set: mutual TLS
  bool metrics_tls = false;        // /metrics over HTTPS with the same certificate
  std::string auth_token_file;     // set: calls need the bearer token it holds
  std::string auth_open = "health,live,ready,metrics";  // open without the token
};

// Fills `flags` from the command line. nullopt: serve; otherwise the exit
// status main() returns (0 after --help or --version, 1 for an unknown flag
// or a value of the wrong type, with one line on stderr).
std::optional<int> ParseCommandLine(int argc, char** argv, std::string_view version,
                                    ServerFlags& flags);

// INVALID_ARGUMENT naming the first flag whose value is out of range.
absl::Status CheckFlags(const ServerFlags& flags);

// What the KV cache pool may take, in bytes, for --kv-cache-memory=`value`:
//   "0"                       no KV cache: sessions are off
//   an integer with an optional unit, K, M, G or T (powers of 1024, also
//   spelled KiB/KB, ...): that many bytes ("4GiB", "512M", "1073741824")
//   a decimal fraction in (0, 1], such as "0.5": that share of `available`,
//   what the backend reports it could give the pool (Backend::KvMemoryAvailable)
//   "auto"                    `auto_fraction` of `available`
// INVALID_ARGUMENT for anything else, quoting the value.
absl::StatusOr<int64_t> KvCacheBytes(std::string_view value, int64_t available,
                                     double auto_fraction);

// --kv-cache-dtype, parsed: what the backends are given and ModelConfig
// advertises. Flags that passed CheckFlags parse; anything else reads as
// auto.
KvCacheDType KvCacheDTypeOf(const ServerFlags& flags);

}  // namespace layerserve
