// Prometheus metrics for layerserve, fed through the core's ServerObserver
// interface. MetricsHttpServer (metrics_http.h) serves their text.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/core/observer.h"

namespace layerserve {

// What the server was built and started as, for layerserve_build_info.
struct BuildInfo {
  std::string version;  // the server's version string
  std::string backend;  // "cpu" or "cuda"
  std::string device;   // e.g. "NVIDIA H100 80GB HBM3", or "cpu"
};

// The configured limits, exported so that alerts and dashboards compare with
// them instead of hard-coding numbers (the flags of the same names).
struct ServingLimits {
  int64_t max_queue_size = 0;    // requests the queue holds
  int64_t max_queue_bytes = 0;   // tensor bytes the queue holds
  int64_t max_batch_tokens = 0;  // tokens per batch (and per request)
  double max_queue_delay_seconds = 0;
};

// The paged KV cache that sessions keep their keys and values in, as the
// server configured it at start (exported, as ServingLimits are, so that
// dashboards and alerts compare with it instead of hard-coding numbers).
struct KvCacheInfo {
  int64_t block_tokens = 0;  // tokens per block
  int64_t blocks = 0;        // blocks in the pool
  int64_t bytes = 0;         // bytes of the pool (every block, all layers)
  int64_t max_sessions = 0;  // sessions open at once
};

// The kernel one projection shape runs in one token-count bucket, as the GEMM
// router chose it at load (the CUDA backend's table; its start-up log prints
// the same), for layerserve_gemm_route.
struct GemmRouteInfo {
  std::string shape;      // "NxK", e.g. "6144x4096"
  bool gated = false;     // the MLP's gate/up with its SiLU gate
  std::string precision;  // "bf16", "fp8-row" or "fp8-block"
  int64_t m_max = 0;      // the bucket's largest token count
  std::string kernel;     // the configuration spelling: "v0" (cuBLASLt), "v4s2", "v6"...
};

// Metric families (all names carry the layerserve_ prefix, times in seconds):
//   layerserve_requests_total{model,code}               counter
//   layerserve_rejections_total{model,reason}           counter (see RejectionReason)
//   layerserve_request_duration_seconds{model}          histogram
//   layerserve_request_tokens{model}                    histogram (B*T of each valid request)
//   layerserve_queue_duration_seconds{model}            histogram
//   layerserve_compute_duration_seconds{model}          histogram (per batch)
//   layerserve_request_compute_seconds{model}           histogram (per request that ran: its
//       batches' compute, so request - queue - this is its time outside batches)
//   layerserve_reply_wait_seconds{model}                histogram (per request that ran: its
//       batch's end to a reply thread taking it up, part of that outside time)
//   layerserve_batch_size{model}                        histogram (requests per execution)
//   layerserve_batch_tokens{model}                      histogram
//   layerserve_queue_depth{model}                       gauge
//   layerserve_inflight_requests{model}                 gauge
//   layerserve_kernel_duration_seconds{model,op}        histogram (CUDA backend, sampled)
//   layerserve_gpu_memory_used_bytes{model}             gauge (CUDA backend)
//   layerserve_kernel_timing_sample_every{model}        gauge (CUDA backend): kernel
//       timings sample one batch in this many (0: none), the factor from the
//       sampled kernel time to the device's
//   layerserve_batch_launches_total{model,launch}       counter (CUDA backend): batches
//       by how their layers were launched, direct, captured or replayed
//       (BatchTimings::launch)
//   layerserve_build_info{version,backend,device}       gauge, 1 (after SetBuildInfo)
//   layerserve_max_queue_size{model}                    gauge (after SetLimits)
//   layerserve_max_queue_bytes{model}                   gauge (after SetLimits)
//   layerserve_max_batch_tokens{model}                  gauge (after SetLimits)
//   layerserve_max_queue_delay_seconds{model}           gauge (after SetLimits)
//   layerserve_gemm_route{model,shape,gated,precision,m_max,kernel}  gauge, 1
//       (CUDA backend, after SetGemmRoutes): the kernel each projection shape
//       runs for batches of up to m_max tokens (v0 cuBLASLt, v3-v6 ours)
//   layerserve_expert_tokens_total{model,layer,expert}  counter (after SetExperts): tokens
//       each expert of a mixture-of-experts layer computed (a token counts
//       once for each expert it is routed to); layer is the model's index
// Sessions and their KV cache, all exported only after SetKvCache (which a
// server calls when its backend keeps a KV cache; one that does not exports
// none of these, so that no ratio alert or panel reads 0 / 0 or compares with
// a limit of 0):
//   layerserve_sessions_open{model}                     gauge
//   layerserve_sessions_in_flight{model}                gauge (open with a step running)
//   layerserve_kv_cache_blocks_used{model}              gauge (held by open sessions)
//   layerserve_kv_cache_blocks{model}                   gauge (the pool's blocks)
//   layerserve_kv_cache_block_tokens{model}             gauge
//   layerserve_kv_cache_bytes{model}                    gauge (the pool's bytes)
//   layerserve_max_sessions{model}                      gauge
//   layerserve_sessions_freed_total{model,reason}       counter: end (a step with
//       sequence_end), idle_timeout, reset (replaced by a sequence_start),
//       drain (still open when a shutdown's --drain-sessions-timeout-s ran out)
//   layerserve_session_steps_rejected_total{model,reason}  counter: kv_memory
//       (too few free KV cache blocks for the step; RESOURCE_EXHAUSTED, so
//       also in rejections_total{reason="resource_exhausted"})
// and the standard process families, read from /proc at each scrape:
//   process_cpu_seconds_total, process_resident_memory_bytes,
//   process_virtual_memory_bytes, process_open_fds, process_max_fds,
//   process_start_time_seconds, process_threads
// Duration buckets span 50 us to 10 s in ten steps a decade (the R10
// series, each bound 1.25-1.28x the one before), so that histogram_quantile's
// interpolation inside one bucket errs by at most ~25% rather than the 2.5x
// of a 1-2.5-5 series. Calls that name a model this process does not serve
// count under model="other" (client text never becomes a label).
class PrometheusMetrics final : public ServerObserver {
 public:
  explicit PrometheusMetrics(std::string model_name);
  ~PrometheusMetrics() override;

  // Sets layerserve_build_info's one series (a later call replaces it).
  void SetBuildInfo(const BuildInfo& info);
  // Sets the layerserve_max_* gauges.
  void SetLimits(const ServingLimits& limits);
  // Creates the session and KV cache families (see above) and sets the
  // configuration gauges; a later call sets them again. Call it once at start,
  // before serving, when the backend keeps a KV cache. Thread-safe.
  void SetKvCache(const KvCacheInfo& info);
  // Creates layerserve_expert_tokens_total's series for model layers
  // [first_layer, first_layer + layers) of `experts` experts each; batches
  // whose BatchRecord::expert_tokens holds layers x experts counts advance
  // them. Call once at start, before serving, for a mixture-of-experts span.
  void SetExperts(int64_t first_layer, int64_t layers, int64_t experts);
  // Sets layerserve_gemm_route's series (a later call replaces them).
  void SetGemmRoutes(const std::vector<GemmRouteInfo>& routes);

  void OnRequestFinished(const RequestRecord& r) override;
  void OnDequeued(const DequeueRecord& r) override;
  void OnBatchExecuted(const BatchRecord& r) override;
  void OnQueueDepth(int64_t requests) override;
  void OnInflight(int64_t requests) override;
  // Sets the session gauges and advances the session counters by what the
  // cumulative counts in `stats` grew since the largest seen (reports may
  // arrive from several threads, out of order: an older report never moves a
  // counter back nor, when its counts show it older, a gauge). Ignored before
  // SetKvCache; the counts are cumulative, so nothing is lost.
  void OnSessions(const SessionTableStats& stats) override;

  // Device time of one kernel launch of a sampled batch; `op` is a backend's
  // fixed op name ("gemm_qkv", "attention", ...). Thread-safe.
  void OnKernelTime(std::string_view op, double seconds);
  // GPU memory in use on the serving device.
  void SetGpuMemoryUsedBytes(int64_t bytes);
  // One batch in `every` has its kernels timed (0: none).
  void SetKernelTimingSampleEvery(int64_t every);

  // The exposition text (Prometheus text format 0.0.4) of every family.
  std::string Serialize() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The reason label of layerserve_rejections_total for a request's canonical
// code, or "" when the code is no rejection (OK, or an error while serving:
// INTERNAL, UNKNOWN, ...). `served_model`: the call named the model this
// server serves (RequestRecord::model not empty). A fixed set:
//   resource_exhausted  RESOURCE_EXHAUSTED: the queue is full (by count or
//                       bytes), the reply would be too large, or a session
//                       step found too few free KV cache blocks (also in
//                       session_steps_rejected_total), has more sequences
//                       than the pool has blocks, would pass the session's
//                       token limit, or would start a session past
//                       max_sessions
//   invalid             INVALID_ARGUMENT
//   unknown_model       NOT_FOUND for a model or version this server does not
//                       serve (only under model="other")
//   unknown_session     NOT_FOUND for the served model: no such session, or it
//                       was freed for idleness or dropped by a drain
//   session_state       FAILED_PRECONDITION: a session request out of turn
//                       (a sequence_start while the session has a request
//                       queued or running, a sequence_position past the
//                       session's length), or one sent to a server that keeps
//                       no sessions
//   unavailable         UNAVAILABLE: not ready, or draining
//   deadline            DEADLINE_EXCEEDED: expired before it ran
//   cancelled           CANCELLED by the client
//   unauthenticated     UNAUTHENTICATED: a call of any RPC without the bearer
//                       token (--auth-token-file); only under model="other"
std::string_view RejectionReason(std::string_view code, bool served_model);

}  // namespace layerserve
