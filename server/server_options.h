// The option structs of the parts main.cc wires, each built from the parsed
// flags here and nowhere else, so main.cc wires and does not copy. Every
// builder is a pure function of the flags and of what start-up learned
// (the model's span, the backend's KV block size and free memory), so
// tests/unit/server checks them without a server: flags in, options out, bad
// combinations refused. The flags themselves are server_flags.h's; the
// security flags, which read files, are server_security.h's; the CUDA
// backend's options are cuda_backend_flags.h's (a CUDA build only).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/core/backend.h"
#include "server/core/batcher.h"
#include "server/core/sessions.h"
#include "server/cpu/cpu_backend.h"
#include "server/grpc/grpc_frontend.h"
#include "server/grpc/served_model.h"
#include "server/metrics/prometheus_metrics.h"
#include "server/model/model.h"
#include "server/server_flags.h"
#include "server/server_security.h"

namespace layerserve {

// What to load: the checkpoint (empty: the built-in demo model), the name
// clients address it by, and the layer range.
struct ModelSource {
  std::string model_dir;
  std::string model_name;  // --model-name, else the directory's name, else "demo"
  LayerRange range;
  // For the start-up line: "the built-in demo model" or the directory, then
  // ", all layers" or " layers A:B".
  std::string Description(std::string_view layers_flag) const;
};

// INVALID_ARGUMENT for a --layers that does not parse (CheckFlags says so
// first).
absl::StatusOr<ModelSource> ModelSourceFromFlags(const ServerFlags& flags);

// The name a model directory gives its model: "/m/Llama-3/" names
// "Llama-3"; an empty directory is the demo model, "demo".
std::string DefaultModelName(const std::string& model_dir);

CpuBackendOptions CpuBackendOptionsFromFlags(const ServerFlags& flags);

// The KV cache the flags ask for, against the backend: `block_bytes` is
// Backend::KvBlockBytes(--kv-block-tokens) (0: the backend keeps no KV cache)
// and `available` Backend::KvMemoryAvailable(). Sessions are off, with the
// reason a session request is told, when the backend keeps no cache or
// --kv-cache-memory=0. --kv-cache-memory=auto takes 0.9 of what a CUDA device
// has free (after the weights and arenas, less the backend's reserve) and a
// quarter of a CPU host's available memory, whose pages are taken only as
// sessions fill them. INVALID_ARGUMENT for a size of less than one block.
struct KvCachePlan {
  std::optional<KvCacheShape> shape;  // unset: sessions off
  std::string off_reason;             // why, when off
  int64_t block_bytes = 0;
  int64_t available_bytes = 0;
  // The start-up line: the pool's size, or why sessions are off.
  std::string Summary(const ServerFlags& flags) const;
};
absl::StatusOr<KvCachePlan> PlanKvCache(const ServerFlags& flags, std::string_view backend_name,
                                        int64_t block_bytes, int64_t available);

SessionTableOptions SessionTableOptionsFromFlags(const ServerFlags& flags,
                                                 const KvCacheShape& shape);

// `hidden_size` sizes the default --max-queue-bytes; `sessions` (not owned,
// null: sessions off) goes into the options as is.
BatcherOptions BatcherOptionsFromFlags(const ServerFlags& flags, int64_t hidden_size,
                                       SessionTable* sessions);

// What the edge reports about the model: the span's name, config and layers,
// the batching limits, and the sessions `kv` planned.
ServedModel ServedModelFromFlags(const ServerFlags& flags, const ModelSpan& span,
                                 std::string_view backend_name, const KvCachePlan& kv);

// The gRPC frontend on `port` (the one main reserved), with `security`'s TLS
// and token; --grpc-threads 0 is DefaultQueueThreads().
GrpcFrontendOptions GrpcFrontendOptionsFromFlags(const ServerFlags& flags,
                                                 const ServerSecurity& security, int port,
                                                 std::string_view version);

// The limits exported on /metrics, from what the batcher was given.
ServingLimits ServingLimitsOf(const BatcherOptions& batcher);

// How long a drain waits: first for open sessions to end (zero when sessions
// are off), then for queued work and open calls.
struct DrainOptions {
  absl::Duration sessions_timeout;
  absl::Duration calls_timeout;
};
DrainOptions DrainOptionsFromFlags(const ServerFlags& flags, bool sessions_on);

// The start-up line of the settings a server runs with.
std::string ServingSummary(const ServerFlags& flags, const BatcherOptions& batcher,
                           const GrpcFrontendOptions& grpc, const ServedModel& served);

}  // namespace layerserve
