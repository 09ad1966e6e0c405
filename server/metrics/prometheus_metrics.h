// Prometheus metrics for layerserve, fed through the core's ServerObserver
// interface, and the HTTP endpoint that serves them.
//
// The endpoint is cpp-httplib + prometheus-cpp's TextSerializer rather than
// prometheus-cpp's civetweb Exposer: civetweb starts threads with 100 KB
// stacks, too small for a process that links cuBLASLt (94 KB static TLS).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "server/core/observer.h"

namespace layerserve {

// Metric families (all names carry the layerserve_ prefix, times in seconds):
//   layerserve_requests_total{model,code}               counter
//   layerserve_request_duration_seconds{model}          histogram
//   layerserve_queue_duration_seconds{model}            histogram
//   layerserve_compute_duration_seconds{model}          histogram (per batch)
//   layerserve_batch_size{model}                        histogram (requests per execution)
//   layerserve_batch_tokens{model}                      histogram
//   layerserve_queue_depth{model}                       gauge
//   layerserve_inflight_requests{model}                 gauge
//   layerserve_kernel_duration_seconds{model,op}        histogram (CUDA backend, sampled)
//   layerserve_gpu_memory_used_bytes{model}             gauge (CUDA backend)
// Duration buckets span 50 us to 10 s. Calls that name a model this process
// does not serve count under model="other" (client text never becomes a label).
class PrometheusMetrics final : public ServerObserver {
 public:
  explicit PrometheusMetrics(std::string model_name);
  ~PrometheusMetrics() override;

  void OnRequestFinished(const RequestRecord& r) override;
  void OnDequeued(const DequeueRecord& r) override;
  void OnBatchExecuted(const BatchRecord& r) override;
  void OnQueueDepth(int64_t requests) override;
  void OnInflight(int64_t requests) override;

  // Device time of one kernel launch of a sampled batch; `op` is a backend's
  // fixed op name ("gemm_qkv", "attention", ...). Thread-safe.
  void OnKernelTime(std::string_view op, double seconds);
  // GPU memory in use on the serving device.
  void SetGpuMemoryUsedBytes(int64_t bytes);

  // The exposition text (Prometheus text format 0.0.4) of every family.
  std::string Serialize() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Serves GET /metrics (and GET /healthz) on its own thread.
class MetricsHttpServer {
 public:
  // Binds `host:port` (port 0 picks a free one) and starts serving.
  // `metrics` must outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& host, int port,
                                                                  const PrometheusMetrics* metrics);
  ~MetricsHttpServer();  // Stop()
  int port() const;
  void Stop();

 private:
  MetricsHttpServer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace layerserve
