// The option structs built from the flags (see server_options.h).
#include "server/server_options.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "server/grpc/completion_queues.h"

namespace layerserve {

std::string DefaultModelName(const std::string& model_dir) {
  if (model_dir.empty()) return "demo";
  std::filesystem::path path(model_dir);
  if (!path.has_filename()) path = path.parent_path();  // "dir/" names "dir"
  const std::string name = path.filename().string();
  return name.empty() ? "model" : name;
}

absl::StatusOr<ModelSource> ModelSourceFromFlags(const ServerFlags& flags) {
  ModelSource source;
  source.model_dir = flags.model_dir;
  source.model_name =
      flags.model_name.empty() ? DefaultModelName(flags.model_dir) : flags.model_name;
  LS_ASSIGN_OR_RETURN(source.range, ParseLayerRange(flags.layers));
  return source;
}

std::string ModelSource::Description(std::string_view layers_flag) const {
  return absl::StrCat(model_dir.empty() ? std::string("the built-in demo model") : model_dir,
                      layers_flag.empty() || layers_flag == ":"
                          ? std::string(", all layers")
                          : absl::StrCat(" layers ", std::string(layers_flag)));
}

CpuBackendOptions CpuBackendOptionsFromFlags(const ServerFlags& flags) {
  CpuBackendOptions options;
  options.num_threads = flags.cpu_threads;
  options.kv_cache_dtype = KvCacheDTypeOf(flags);
  return options;
}

absl::StatusOr<KvCachePlan> PlanKvCache(const ServerFlags& flags, std::string_view backend_name,
                                        int64_t block_bytes, int64_t available) {
  KvCachePlan plan;
  plan.block_bytes = block_bytes;
  plan.available_bytes = available;
  if (block_bytes <= 0) {
    plan.off_reason =
        absl::StrCat("the ", std::string(backend_name), " backend keeps no KV cache yet");
    return plan;
  }
  const double auto_fraction = backend_name == "cuda" ? 0.9 : 0.25;
  LS_ASSIGN_OR_RETURN(const int64_t bytes,
                      KvCacheBytes(flags.kv_cache_memory, available, auto_fraction));
  if (bytes == 0 && flags.kv_cache_memory == "0") {
    plan.off_reason = "--kv-cache-memory=0";
    return plan;
  }
  const int64_t blocks = std::min<int64_t>(bytes / block_bytes, INT32_MAX);
  if (blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-memory=", flags.kv_cache_memory, " gives ", bytes,
                     " bytes, less than one KV cache block of ", flags.kv_block_tokens, " tokens (",
                     block_bytes, " bytes for this span)"));
  }
  plan.shape = KvCacheShape{.num_blocks = static_cast<int32_t>(blocks),
                            .block_tokens = flags.kv_block_tokens};
  return plan;
}

std::string KvCachePlan::Summary(const ServerFlags& flags) const {
  if (!shape) {
    if (block_bytes <= 0) {
      return absl::StrCat("sessions: off (", off_reason,
                          "); requests with a sequence_id are refused");
    }
    return absl::StrCat("sessions: off (", off_reason, ")");
  }
  const int64_t blocks = shape->num_blocks;
  const double mib = static_cast<double>(blocks * block_bytes) / (1 << 20);
  return absl::StrCat("sessions: KV cache of ", blocks, " blocks x ", shape->block_tokens,
                      " tokens = ", blocks * shape->block_tokens, " tokens in ",
                      absl::StrFormat("%.1f", mib), " MiB (", block_bytes / shape->block_tokens,
                      " bytes per token; --kv-cache-dtype=", flags.kv_cache_dtype,
                      " --kv-cache-memory=", flags.kv_cache_memory, " of ", available_bytes,
                      " bytes available); max_sessions=", flags.max_sessions,
                      " max_session_tokens=", flags.max_session_tokens,
                      " session_idle_timeout_s=", flags.session_idle_timeout_s);
}

SessionTableOptions SessionTableOptionsFromFlags(const ServerFlags& flags,
                                                 const KvCacheShape& shape) {
  SessionTableOptions options;
  options.num_blocks = shape.num_blocks;
  options.block_tokens = shape.block_tokens;
  options.max_sessions = flags.max_sessions;
  options.max_session_tokens = flags.max_session_tokens;
  options.idle_timeout = std::chrono::seconds(flags.session_idle_timeout_s);
  return options;
}

BatcherOptions BatcherOptionsFromFlags(const ServerFlags& flags, int64_t hidden_size,
                                       SessionTable* sessions) {
  BatcherOptions options;
  options.policy.max_batch_tokens = flags.max_batch_tokens;
  options.policy.max_queue_delay = std::chrono::microseconds(flags.max_queue_delay_us);
  options.policy.delay_when_idle = flags.batch_delay_when_idle;
  options.policy.max_device_wait = std::chrono::microseconds(flags.max_device_wait_us);
  options.policy.device_lead = std::chrono::microseconds(flags.device_lead_us);
  options.max_queue_size = flags.max_queue_size;
  options.reply_threads = flags.reply_threads;
  options.max_queue_bytes = flags.max_queue_bytes > 0
                                ? flags.max_queue_bytes
                                : DefaultMaxQueueBytes(options.policy, hidden_size);
  options.sessions = sessions;
  options.prefill_chunk_tokens = flags.prefill_chunk_tokens;
  return options;
}

ServedModel ServedModelFromFlags(const ServerFlags& flags, const ModelSpan& span,
                                 std::string_view backend_name, const KvCachePlan& kv) {
  ServedModel served;
  served.name = span.name;
  served.config = span.config;
  served.first_layer = span.first_layer;
  served.num_layers = static_cast<int64_t>(span.layers.size());
  served.backend = std::string(backend_name);
  served.max_batch_tokens = flags.max_batch_tokens;
  served.max_queue_delay_us = flags.max_queue_delay_us;
  served.max_queue_size = flags.max_queue_size;
  if (!kv.shape) {
    served.sessions_off_reason = kv.off_reason;
    return served;
  }
  served.sessions = true;
  served.kv_block_tokens = kv.shape->block_tokens;
  served.kv_blocks = kv.shape->num_blocks;
  served.kv_cache_dtype = KvCacheDTypeOf(flags);
  served.max_sessions = flags.max_sessions;
  served.max_session_tokens = flags.max_session_tokens;
  served.session_idle_timeout_us = flags.session_idle_timeout_s * 1'000'000;
  return served;
}

GrpcFrontendOptions GrpcFrontendOptionsFromFlags(const ServerFlags& flags,
                                                 const ServerSecurity& security, int port,
                                                 std::string_view version) {
  GrpcFrontendOptions options;
  options.host = flags.host;
  options.port = port;
  options.server_version = std::string(version);
  options.max_connection_age_s = flags.grpc_max_connection_age_s;
  options.max_connection_idle_s = flags.grpc_max_connection_idle_s;
  options.max_concurrent_streams = static_cast<int>(flags.grpc_max_concurrent_streams);
  options.queue_threads = flags.grpc_threads > 0 ? flags.grpc_threads : DefaultQueueThreads();
  options.max_connection_age_grace_s = flags.drain_timeout_s;
  options.tls = security.grpc_tls;
  options.auth_token = security.auth_token;
  options.auth_open = security.auth_open;
  return options;
}

ServingLimits ServingLimitsOf(const BatcherOptions& batcher) {
  return {.max_queue_size = batcher.max_queue_size,
          .max_queue_bytes = batcher.max_queue_bytes,
          .max_batch_tokens = batcher.policy.max_batch_tokens,
          .max_queue_delay_seconds =
              std::chrono::duration<double>(batcher.policy.max_queue_delay).count()};
}

DrainOptions DrainOptionsFromFlags(const ServerFlags& flags, bool sessions_on) {
  return {.sessions_timeout = absl::Seconds(sessions_on ? flags.drain_sessions_timeout_s : 0),
          .calls_timeout = absl::Seconds(flags.drain_timeout_s)};
}

std::string ServingSummary(const ServerFlags& flags, const BatcherOptions& batcher,
                           const GrpcFrontendOptions& grpc, const ServedModel& served) {
  const BatchPolicy& policy = batcher.policy;
  return absl::StrCat(
      "max_batch_tokens=", policy.max_batch_tokens, " max_queue_delay_us=",
      std::chrono::duration_cast<std::chrono::microseconds>(policy.max_queue_delay).count(),
      policy.delay_when_idle ? " (also when idle)" : " (while busy)",
      " max_device_wait_us=", flags.max_device_wait_us, " device_lead_us=", flags.device_lead_us,
      " max_queue_size=", batcher.max_queue_size, " max_queue_bytes=", batcher.max_queue_bytes,
      " cpu_threads=", flags.cpu_threads, " streams=", flags.streams,
      " max_message_bytes=", DefaultMaxMessageBytes(served), " grpc_threads=", grpc.queue_threads,
      " grpc_max_concurrent_streams=", grpc.max_concurrent_streams,
      " reply_threads=", batcher.reply_threads, " drain_timeout_s=", flags.drain_timeout_s,
      " drain_sessions_timeout_s=", flags.drain_sessions_timeout_s);
}

}  // namespace layerserve
