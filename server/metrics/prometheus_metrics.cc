// PrometheusMetrics: the core's ServerObserver callbacks turned into
// prometheus-cpp collectors, and their exposition text. See
// prometheus_metrics.h for the families.
#include "server/metrics/prometheus_metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "base/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace layerserve {
namespace {

// Ten bounds a decade (the Renard R10 series) from 50 us to 10 s: one
// inference of a few layers takes anywhere from tens of microseconds (tiny
// model, GPU) to seconds (large batch on CPU), and queue waits sit at the low
// end. Neighbouring bounds differ by 25-28%, which bounds the error of
// histogram_quantile's linear interpolation inside a bucket; a 1-2.5-5
// series let a p99 of 11 ms read as 24.9 ms. Each bound is an integer divided
// by a power of ten, so it is the double nearest its decimal (0.0025, not
// 0.0025000000000000005) and the le labels read cleanly.
std::vector<double> DurationBucketsSeconds() {
  constexpr int kR10Hundredths[] = {100, 125, 160, 200, 250, 315, 400, 500, 630, 800};
  std::vector<double> bounds;
  for (int exponent = -5; exponent <= 1; ++exponent) {  // bound = m/100 * 10^exponent
    for (int m : kR10Hundredths) {
      const int shift = exponent - 2;
      const double bound = shift < 0 ? m / std::pow(10.0, -shift) : m * std::pow(10.0, shift);
      if (bound >= 50e-6 - 1e-18 && bound <= 10.0) bounds.push_back(bound);
    }
  }
  return bounds;
}

// Device time of one kernel launch: from a microsecond (an elementwise op at
// one token) to a tenth of a second (a large GEMM or attention).
std::vector<double> KernelBucketsSeconds() {
  return {1e-6,   2.5e-6, 5e-6,   10e-6, 25e-6, 50e-6, 100e-6, 250e-6,
          500e-6, 1e-3,   2.5e-3, 5e-3,  10e-3, 25e-3, 50e-3,  100e-3};
}

// Powers of two from 1 up to and including `max`.
std::vector<double> PowersOfTwoUpTo(double max) {
  std::vector<double> bounds;
  for (double b = 1; b <= max; b *= 2) bounds.push_back(b);
  return bounds;
}

// Requests that name a model this process does not serve are counted under
// this label value: the name comes from the client, and copying it into a
// label would let any client create unbounded series.
constexpr char kOtherModelLabel[] = "other";

// The reasons a call for the served model can be rejected for (see
// RejectionReason); unknown_model is only ever counted under model="other".
constexpr std::string_view kRejectionReasons[] = {
    "resource_exhausted", "invalid",  "unknown_session", "session_state",
    "unavailable",        "deadline", "cancelled"};
constexpr char kUnknownModelReason[] = "unknown_model";
// A call refused for want of the bearer token (--auth-token-file), of any
// RPC: also only ever counted under model="other".
constexpr char kUnauthenticatedReason[] = "unauthenticated";

// --- process_* families, read from /proc at scrape time ------------------------
// prometheus-cpp has no process collector; these follow the names, types and
// units of the Prometheus client libraries' (Go, Python) process collectors.

std::string ReadFile(const char* path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The value of a "Name:   value kB" line of /proc/self/status, or -1.
double StatusField(const std::string& status, std::string_view name) {
  const std::string key = "\n" + std::string(name) + ":";
  size_t at = status.find(key);
  if (at == std::string::npos) return -1;
  at += key.size();
  char* end = nullptr;
  const double value = std::strtod(status.c_str() + at, &end);
  return end == status.c_str() + at ? -1 : value;
}

prometheus::MetricFamily OneSample(std::string name, std::string help, prometheus::MetricType type,
                                   double value) {
  prometheus::MetricFamily family{std::move(name), std::move(help), type, {}};
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(std::move(metric));
  return family;
}

void AppendProcessFamilies(std::vector<prometheus::MetricFamily>& out) {
  using prometheus::MetricType;
  const double ticks_per_second = static_cast<double>(sysconf(_SC_CLK_TCK));
  // /proc/self/stat: the fields after the parenthesized command name (which
  // may itself hold spaces and parentheses) start with field 3, the state.
  const std::string stat = ReadFile("/proc/self/stat");
  const size_t paren = stat.rfind(')');
  if (paren != std::string::npos && ticks_per_second > 0) {
    std::istringstream rest(stat.substr(paren + 1));
    std::vector<std::string> fields;
    for (std::string f; rest >> f;) fields.push_back(f);
    const auto field = [&fields](size_t n) {  // n: the field's number in proc(5)
      if (n - 3 >= fields.size()) return -1.0;
      char* end = nullptr;
      const double value = std::strtod(fields[n - 3].c_str(), &end);
      return *end == '\0' ? value : -1.0;
    };
    const double utime = field(14), stime = field(15), starttime = field(22);
    if (utime >= 0 && stime >= 0) {
      out.push_back(OneSample("process_cpu_seconds_total",
                              "Total user and system CPU time spent in seconds.",
                              MetricType::Counter, (utime + stime) / ticks_per_second));
    }
    const std::string proc_stat = ReadFile("/proc/stat");
    const size_t btime_at = proc_stat.find("\nbtime ");
    if (starttime >= 0 && btime_at != std::string::npos) {
      const double boot = std::strtod(proc_stat.c_str() + btime_at + 7, nullptr);
      out.push_back(OneSample("process_start_time_seconds",
                              "Start time of the process since unix epoch in seconds.",
                              MetricType::Gauge, boot + starttime / ticks_per_second));
    }
  }
  const std::string status = ReadFile("/proc/self/status");
  if (const double rss_kb = StatusField(status, "VmRSS"); rss_kb >= 0) {
    out.push_back(OneSample("process_resident_memory_bytes", "Resident memory size in bytes.",
                            MetricType::Gauge, rss_kb * 1024));
  }
  if (const double vm_kb = StatusField(status, "VmSize"); vm_kb >= 0) {
    out.push_back(OneSample("process_virtual_memory_bytes", "Virtual memory size in bytes.",
                            MetricType::Gauge, vm_kb * 1024));
  }
  if (const double threads = StatusField(status, "Threads"); threads >= 0) {
    out.push_back(
        OneSample("process_threads", "Number of OS threads.", MetricType::Gauge, threads));
  }
  std::error_code error;
  double fds = 0;
  for (std::filesystem::directory_iterator it("/proc/self/fd", error), end; !error && it != end;
       it.increment(error)) {
    ++fds;
  }
  if (!error) {
    out.push_back(
        OneSample("process_open_fds", "Number of open file descriptors.", MetricType::Gauge, fds));
  }
  if (rlimit limit{}; getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    out.push_back(
        OneSample("process_max_fds", "Maximum number of open file descriptors.", MetricType::Gauge,
                  limit.rlim_cur == RLIM_INFINITY ? -1.0 : static_cast<double>(limit.rlim_cur)));
  }
}

}  // namespace

std::string_view RejectionReason(std::string_view code, bool served_model) {
  if (code == "RESOURCE_EXHAUSTED") return "resource_exhausted";
  if (code == "INVALID_ARGUMENT") return "invalid";
  // The edge answers NOT_FOUND for a model it does not serve before the call
  // reaches the core; past that, only the session table says NOT_FOUND.
  if (code == "NOT_FOUND") return served_model ? "unknown_session" : kUnknownModelReason;
  if (code == "FAILED_PRECONDITION") return "session_state";
  if (code == "UNAVAILABLE") return "unavailable";
  if (code == "DEADLINE_EXCEEDED") return "deadline";
  if (code == "CANCELLED") return "cancelled";
  if (code == "UNAUTHENTICATED") return kUnauthenticatedReason;
  return "";
}

namespace {

// The series of the session and KV cache families for the served model.
struct SessionSeries {
  SessionSeries(prometheus::Registry& registry, const prometheus::Labels& model);

  prometheus::Family<prometheus::Counter>& freed;
  prometheus::Family<prometheus::Counter>& steps_rejected;
  prometheus::Gauge& open;
  prometheus::Gauge& in_flight;
  prometheus::Gauge& blocks_used;
  prometheus::Gauge& blocks;
  prometheus::Gauge& block_tokens;
  prometheus::Gauge& bytes;
  prometheus::Gauge& max_sessions;
  prometheus::Counter& freed_end;
  prometheus::Counter& freed_idle;
  prometheus::Counter& freed_reset;
  prometheus::Counter& freed_drain;
  prometheus::Counter& rejected_kv_memory;
};

prometheus::Gauge& AddGauge(prometheus::Registry& registry, const char* name, const char* help,
                            const prometheus::Labels& labels) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add(labels);
}

prometheus::Labels WithReason(prometheus::Labels labels, const char* reason) {
  labels.emplace("reason", reason);
  return labels;
}

SessionSeries::SessionSeries(prometheus::Registry& registry, const prometheus::Labels& model)
    : freed(prometheus::BuildCounter()
                .Name("layerserve_sessions_freed_total")
                .Help("Sessions freed, by reason: end (a step with sequence_end), idle_timeout, "
                      "reset (replaced by a sequence_start), drain (still open when a shutdown's "
                      "time for sessions ran out).")
                .Register(registry)),
      steps_rejected(prometheus::BuildCounter()
                         .Name("layerserve_session_steps_rejected_total")
                         .Help("Session steps refused, by reason: kv_memory (too few free KV "
                               "cache blocks).")
                         .Register(registry)),
      open(AddGauge(registry, "layerserve_sessions_open", "Sessions open.", model)),
      in_flight(AddGauge(registry, "layerserve_sessions_in_flight",
                         "Open sessions with a step running.", model)),
      blocks_used(AddGauge(registry, "layerserve_kv_cache_blocks_used",
                           "KV cache blocks held by open sessions.", model)),
      blocks(
          AddGauge(registry, "layerserve_kv_cache_blocks", "Blocks in the KV cache pool.", model)),
      block_tokens(AddGauge(registry, "layerserve_kv_cache_block_tokens",
                            "Tokens per KV cache block.", model)),
      bytes(AddGauge(registry, "layerserve_kv_cache_bytes", "Bytes of the KV cache pool.", model)),
      max_sessions(
          AddGauge(registry, "layerserve_max_sessions", "Sessions open at once, at most.", model)),
      freed_end(freed.Add(WithReason(model, "end"))),
      freed_idle(freed.Add(WithReason(model, "idle_timeout"))),
      freed_reset(freed.Add(WithReason(model, "reset"))),
      freed_drain(freed.Add(WithReason(model, "drain"))),
      rejected_kv_memory(steps_rejected.Add(WithReason(model, "kv_memory"))) {}

// The counter's increase from `seen` to `now` (cumulative counts), never
// negative: an older report may arrive after a newer one.
void Advance(prometheus::Counter& counter, int64_t now, int64_t& seen) {
  if (now <= seen) return;
  counter.Increment(static_cast<double>(now - seen));
  seen = now;
}

}  // namespace

struct PrometheusMetrics::Impl {
  explicit Impl(std::string name)
      : model_name(std::move(name)),
        registry(std::make_shared<prometheus::Registry>()),
        requests(prometheus::BuildCounter()
                     .Name("layerserve_requests_total")
                     .Help("ModelInfer calls answered, by model and canonical status code; "
                           "calls of any RPC refused UNAUTHENTICATED count under model=\"other\".")
                     .Register(*registry)),
        rejections(prometheus::BuildCounter()
                       .Name("layerserve_rejections_total")
                       .Help("ModelInfer calls refused or dropped without a result, by reason "
                             "(unauthenticated: calls of any RPC).")
                       .Register(*registry)),
        request_tokens(prometheus::BuildHistogram()
                           .Name("layerserve_request_tokens")
                           .Help("Tokens (B*T) of each valid ModelInfer request.")
                           .Register(*registry)),
        build_info(prometheus::BuildGauge()
                       .Name("layerserve_build_info")
                       .Help("1, labelled with the server's version, backend and device.")
                       .Register(*registry)),
        gemm_route(
            prometheus::BuildGauge()
                .Name("layerserve_gemm_route")
                .Help("1 for the kernel each projection shape runs for batches of up to m_max "
                      "tokens (v0 cuBLASLt, v3-v6 the project's), as chosen at load.")
                .Register(*registry)),
        max_queue_size(prometheus::BuildGauge()
                           .Name("layerserve_max_queue_size")
                           .Help("Requests the queue holds (--max-queue-size).")
                           .Register(*registry)),
        max_queue_bytes(prometheus::BuildGauge()
                            .Name("layerserve_max_queue_bytes")
                            .Help("Tensor bytes the queue holds (--max-queue-bytes).")
                            .Register(*registry)),
        max_batch_tokens(prometheus::BuildGauge()
                             .Name("layerserve_max_batch_tokens")
                             .Help("Tokens per batch and per request (--max-batch-tokens).")
                             .Register(*registry)),
        max_queue_delay(
            prometheus::BuildGauge()
                .Name("layerserve_max_queue_delay_seconds")
                .Help("Longest wait of a batch's oldest request (--max-queue-delay-us).")
                .Register(*registry)),
        request_duration(prometheus::BuildHistogram()
                             .Name("layerserve_request_duration_seconds")
                             .Help("ModelInfer latency from receipt to reply.")
                             .Register(*registry)),
        queue_duration(prometheus::BuildHistogram()
                           .Name("layerserve_queue_duration_seconds")
                           .Help("Time a request waited in the batcher queue.")
                           .Register(*registry)),
        compute_duration(prometheus::BuildHistogram()
                             .Name("layerserve_compute_duration_seconds")
                             .Help("Backend execution time of one batch.")
                             .Register(*registry)),
        request_compute(prometheus::BuildHistogram()
                            .Name("layerserve_request_compute_seconds")
                            .Help("Execution time of the batches one request ran in (summed "
                                  "over its pieces); the request's duration less its queue "
                                  "wait and this is the server's time outside batches.")
                            .Register(*registry)),
        reply_wait(prometheus::BuildHistogram()
                       .Name("layerserve_reply_wait_seconds")
                       .Help("Time a computed request waited for a reply thread "
                             "(--reply-threads), from its batch's end.")
                       .Register(*registry)),
        batch_stage(prometheus::BuildHistogram()
                        .Name("layerserve_batch_stage_seconds")
                        .Help("Parts of a batch's compute time: input (tensors into the "
                              "backend's buffers), infer (the layers; on CUDA also the device "
                              "copies), output (results back into the requests).")
                        .Register(*registry)),
        batch_size(prometheus::BuildHistogram()
                       .Name("layerserve_batch_size")
                       .Help("Requests per backend execution.")
                       .Register(*registry)),
        batch_tokens(prometheus::BuildHistogram()
                         .Name("layerserve_batch_tokens")
                         .Help("Tokens (sum of B*T) per backend execution.")
                         .Register(*registry)),
        queue_depth(prometheus::BuildGauge()
                        .Name("layerserve_queue_depth")
                        .Help("Requests waiting in the batcher queue.")
                        .Register(*registry)),
        inflight(prometheus::BuildGauge()
                     .Name("layerserve_inflight_requests")
                     .Help("Requests accepted and not yet answered.")
                     .Register(*registry)),
        kernel_duration(prometheus::BuildHistogram()
                            .Name("layerserve_kernel_duration_seconds")
                            .Help("GPU time of one kernel launch, by op (sampled batches).")
                            .Register(*registry)),
        batch_launches(prometheus::BuildCounter()
                           .Name("layerserve_batch_launches_total")
                           .Help("Batches the CUDA backend ran, by how it launched their layers: "
                                 "direct (kernel by kernel), captured (launched directly, then "
                                 "recorded into a CUDA graph for the later batches of its shape) "
                                 "or replayed (a graph captured before).")
                           .Register(*registry)),
        gpu_memory_used(prometheus::BuildGauge()
                            .Name("layerserve_gpu_memory_used_bytes")
                            .Help("GPU memory in use on the serving device.")
                            .Register(*registry)),
        kernel_timing_sample_every(
            prometheus::BuildGauge()
                .Name("layerserve_kernel_timing_sample_every")
                .Help("Kernel timings sample one batch in this many (0: none): "
                      "layerserve_kernel_duration_seconds times this is the device's time.")
                .Register(*registry)),
        request_duration_model(request_duration.Add(ModelLabel(), DurationBucketsSeconds())),
        request_tokens_model(request_tokens.Add(ModelLabel(), PowersOfTwoUpTo(65536))),
        queue_duration_model(queue_duration.Add(ModelLabel(), DurationBucketsSeconds())),
        compute_duration_model(compute_duration.Add(ModelLabel(), DurationBucketsSeconds())),
        request_compute_model(request_compute.Add(ModelLabel(), DurationBucketsSeconds())),
        reply_wait_model(reply_wait.Add(ModelLabel(), DurationBucketsSeconds())),
        batch_input_model(batch_stage.Add(StageLabels("input"), DurationBucketsSeconds())),
        batch_infer_model(batch_stage.Add(StageLabels("infer"), DurationBucketsSeconds())),
        batch_output_model(batch_stage.Add(StageLabels("output"), DurationBucketsSeconds())),
        batch_size_model(batch_size.Add(ModelLabel(), PowersOfTwoUpTo(1024))),
        batch_tokens_model(batch_tokens.Add(ModelLabel(), PowersOfTwoUpTo(65536))),
        queue_depth_model(queue_depth.Add(ModelLabel())),
        inflight_model(inflight.Add(ModelLabel())),
        // Present from the first scrape, so that rate() has a zero to start from.
        requests_ok_model(requests.Add({{"model", model_name}, {"code", "OK"}})) {
    for (std::string_view reason : kRejectionReasons) {
      rejections.Add({{"model", model_name}, {"reason", std::string(reason)}});
    }
    rejections.Add({{"model", kOtherModelLabel}, {"reason", kUnknownModelReason}});
    rejections.Add({{"model", kOtherModelLabel}, {"reason", kUnauthenticatedReason}});
  }

  prometheus::Labels ModelLabel() const { return {{"model", model_name}}; }
  prometheus::Labels StageLabels(const std::string& stage) const {
    return {{"model", model_name}, {"stage", stage}};
  }

  const std::string model_name;
  std::shared_ptr<prometheus::Registry> registry;
  prometheus::Family<prometheus::Counter>& requests;
  prometheus::Family<prometheus::Counter>& rejections;
  prometheus::Family<prometheus::Histogram>& request_tokens;
  prometheus::Family<prometheus::Gauge>& build_info;
  prometheus::Family<prometheus::Gauge>& gemm_route;
  prometheus::Family<prometheus::Gauge>& max_queue_size;
  prometheus::Family<prometheus::Gauge>& max_queue_bytes;
  prometheus::Family<prometheus::Gauge>& max_batch_tokens;
  prometheus::Family<prometheus::Gauge>& max_queue_delay;
  prometheus::Family<prometheus::Histogram>& request_duration;
  prometheus::Family<prometheus::Histogram>& queue_duration;
  prometheus::Family<prometheus::Histogram>& compute_duration;
  prometheus::Family<prometheus::Histogram>& request_compute;
  prometheus::Family<prometheus::Histogram>& reply_wait;
  prometheus::Family<prometheus::Histogram>& batch_stage;
  prometheus::Family<prometheus::Histogram>& batch_size;
  prometheus::Family<prometheus::Histogram>& batch_tokens;
  prometheus::Family<prometheus::Gauge>& queue_depth;
  prometheus::Family<prometheus::Gauge>& inflight;
  prometheus::Family<prometheus::Histogram>& kernel_duration;  // series made on first use
  prometheus::Family<prometheus::Counter>& batch_launches;     // series made on first use
  prometheus::Family<prometheus::Gauge>& gpu_memory_used;      // set by the CUDA backend only
  prometheus::Family<prometheus::Gauge>& kernel_timing_sample_every;  // likewise
  // SetExperts' series, [layer * experts + expert]; written before serving,
  // read-only after.
  std::vector<prometheus::Counter*> expert_tokens;
  // The single-model series, resolved once; the families own them and every
  // metric is itself thread-safe.
  prometheus::Histogram& request_duration_model;
  prometheus::Histogram& request_tokens_model;
  prometheus::Histogram& queue_duration_model;
  prometheus::Histogram& compute_duration_model;
  prometheus::Histogram& request_compute_model;
  prometheus::Histogram& reply_wait_model;
  prometheus::Histogram& batch_input_model;
  prometheus::Histogram& batch_infer_model;
  prometheus::Histogram& batch_output_model;
  prometheus::Histogram& batch_size_model;
  prometheus::Histogram& batch_tokens_model;
  prometheus::Gauge& queue_depth_model;
  prometheus::Gauge& inflight_model;
  // Nearly every call ends here: resolved once, so that the reply threads do
  // not build a label map and take the family's lock per request.
  prometheus::Counter& requests_ok_model;

  // base's Mutex rather than absl::Mutex: ThreadSanitizer sees its locking
  // (base/mutex.h says why).
  Mutex build_info_mu;
  prometheus::Gauge* build_info_series ABSL_GUARDED_BY(build_info_mu) = nullptr;
  std::vector<prometheus::Gauge*> gemm_route_series ABSL_GUARDED_BY(build_info_mu);

  // The session families, registered by the first SetKvCache so that a
  // server without a KV cache exports none of them.
  Mutex sessions_mu;
  std::unique_ptr<SessionSeries> sessions ABSL_GUARDED_BY(sessions_mu);
  // The largest cumulative counts reported so far: each report advances the
  // counters by what it adds to these.
  SessionTableStats sessions_seen ABSL_GUARDED_BY(sessions_mu);
};

PrometheusMetrics::PrometheusMetrics(std::string model_name)
    : impl_(std::make_unique<Impl>(std::move(model_name))) {}

PrometheusMetrics::~PrometheusMetrics() = default;

void PrometheusMetrics::OnRequestFinished(const RequestRecord& r) {
  const bool served = r.model == impl_->model_name;
  // Family::Add returns the existing series for known labels (under the
  // family's own lock); the code set is the ~16 canonical names.
  if (served && r.code == "OK") {
    impl_->requests_ok_model.Increment();
  } else {
    impl_->requests
        .Add({{"model", served ? impl_->model_name : std::string(kOtherModelLabel)},
              {"code", std::string(r.code)}})
        .Increment();
  }
  if (const std::string_view reason = RejectionReason(r.code, served); !reason.empty()) {
    impl_->rejections
        .Add({{"model", served ? impl_->model_name : std::string(kOtherModelLabel)},
              {"reason", std::string(reason)}})
        .Increment();
  }
  if (!served) return;
  impl_->request_duration_model.Observe(r.duration_seconds);
  if (r.compute_seconds > 0) {
    impl_->request_compute_model.Observe(r.compute_seconds);
    impl_->reply_wait_model.Observe(r.reply_wait_seconds);
  }
  if (r.tokens > 0) impl_->request_tokens_model.Observe(static_cast<double>(r.tokens));
}

void PrometheusMetrics::SetBuildInfo(const BuildInfo& info) {
  MutexLock lock(&impl_->build_info_mu);
  if (impl_->build_info_series != nullptr) impl_->build_info.Remove(impl_->build_info_series);
  impl_->build_info_series = &impl_->build_info.Add(
      {{"version", info.version}, {"backend", info.backend}, {"device", info.device}});
  impl_->build_info_series->Set(1);
}

void PrometheusMetrics::SetGemmRoutes(const std::vector<GemmRouteInfo>& routes) {
  MutexLock lock(&impl_->build_info_mu);
  for (prometheus::Gauge* series : impl_->gemm_route_series) impl_->gemm_route.Remove(series);
  impl_->gemm_route_series.clear();
  for (const GemmRouteInfo& route : routes) {
    prometheus::Gauge& series = impl_->gemm_route.Add({{"model", impl_->model_name},
                                                       {"shape", route.shape},
                                                       {"gated", route.gated ? "true" : "false"},
                                                       {"precision", route.precision},
                                                       {"m_max", std::to_string(route.m_max)},
                                                       {"kernel", route.kernel}});
    series.Set(1);
    impl_->gemm_route_series.push_back(&series);
  }
}

void PrometheusMetrics::SetLimits(const ServingLimits& limits) {
  const prometheus::Labels model = impl_->ModelLabel();
  impl_->max_queue_size.Add(model).Set(static_cast<double>(limits.max_queue_size));
  impl_->max_queue_bytes.Add(model).Set(static_cast<double>(limits.max_queue_bytes));
  impl_->max_batch_tokens.Add(model).Set(static_cast<double>(limits.max_batch_tokens));
  impl_->max_queue_delay.Add(model).Set(limits.max_queue_delay_seconds);
}

void PrometheusMetrics::SetKvCache(const KvCacheInfo& info) {
  MutexLock lock(&impl_->sessions_mu);
  if (impl_->sessions == nullptr) {
    impl_->sessions = std::make_unique<SessionSeries>(*impl_->registry, impl_->ModelLabel());
  }
  SessionSeries& s = *impl_->sessions;
  s.blocks.Set(static_cast<double>(info.blocks));
  s.block_tokens.Set(static_cast<double>(info.block_tokens));
  s.bytes.Set(static_cast<double>(info.bytes));
  s.max_sessions.Set(static_cast<double>(info.max_sessions));
}

void PrometheusMetrics::SetExperts(int64_t first_layer, int64_t layers, int64_t experts) {
  auto& family = prometheus::BuildCounter()
                     .Name("layerserve_expert_tokens_total")
                     .Help(
                         "Tokens each expert of a mixture-of-experts layer computed (a token "
                         "counts once for each expert it is routed to), by model layer.")
                     .Register(*impl_->registry);
  impl_->expert_tokens.clear();
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t e = 0; e < experts; ++e) {
      impl_->expert_tokens.push_back(&family.Add({{"model", impl_->model_name},
                                                  {"layer", std::to_string(first_layer + l)},
                                                  {"expert", std::to_string(e)}}));
    }
  }
}

void PrometheusMetrics::OnSessions(const SessionTableStats& stats) {
  MutexLock lock(&impl_->sessions_mu);
  if (impl_->sessions == nullptr) return;
  SessionSeries& s = *impl_->sessions;
  SessionTableStats& seen = impl_->sessions_seen;
  // Reports are snapshots of one table taken under its lock, and the counts
  // only grow, so a report with any count below one already seen was taken
  // before a report already applied: its gauges would go back in time. (One
  // with equal counts may still be older; the next report corrects it.)
  const bool older = stats.freed_end < seen.freed_end || stats.freed_idle < seen.freed_idle ||
                     stats.freed_reset < seen.freed_reset || stats.freed_drain < seen.freed_drain ||
                     stats.rejected_no_blocks < seen.rejected_no_blocks;
  if (!older) {
    s.open.Set(static_cast<double>(stats.sessions_open));
    s.in_flight.Set(static_cast<double>(stats.sessions_in_flight));
    s.blocks_used.Set(static_cast<double>(stats.blocks_used));
    s.blocks.Set(static_cast<double>(stats.blocks_capacity));
  }
  Advance(s.freed_end, stats.freed_end, seen.freed_end);
  Advance(s.freed_idle, stats.freed_idle, seen.freed_idle);
  Advance(s.freed_reset, stats.freed_reset, seen.freed_reset);
  Advance(s.freed_drain, stats.freed_drain, seen.freed_drain);
  Advance(s.rejected_kv_memory, stats.rejected_no_blocks, seen.rejected_no_blocks);
}

void PrometheusMetrics::OnDequeued(const DequeueRecord& r) {
  impl_->queue_duration_model.Observe(r.queue_seconds);
}

void PrometheusMetrics::OnBatchExecuted(const BatchRecord& r) {
  // Failed batches are observed too: they occupied the backend for that long,
  // and their requests show up under a non-OK code in requests_total.
  impl_->compute_duration_model.Observe(r.compute_seconds);
  impl_->batch_input_model.Observe(r.input_seconds);
  impl_->batch_infer_model.Observe(r.infer_seconds());
  impl_->batch_output_model.Observe(r.output_seconds);
  impl_->batch_size_model.Observe(static_cast<double>(r.requests));
  impl_->batch_tokens_model.Observe(static_cast<double>(r.tokens));
  if (!r.launch.empty()) {
    impl_->batch_launches.Add({{"model", impl_->model_name}, {"launch", std::string(r.launch)}})
        .Increment();
  }
  // Routing of failed batches is not counted: their results were discarded.
  if (r.ok && r.expert_tokens.size() == impl_->expert_tokens.size()) {
    for (size_t i = 0; i < r.expert_tokens.size(); ++i) {
      impl_->expert_tokens[i]->Increment(static_cast<double>(r.expert_tokens[i]));
    }
  }
}

void PrometheusMetrics::OnQueueDepth(int64_t requests) {
  impl_->queue_depth_model.Set(static_cast<double>(requests));
}

void PrometheusMetrics::OnInflight(int64_t requests) {
  impl_->inflight_model.Set(static_cast<double>(requests));
}

void PrometheusMetrics::OnKernelTime(std::string_view op, double seconds) {
  // Family::Add returns the existing series after the first call for an op
  // (a fixed set of ~8 names chosen by the backend, never by a client).
  impl_->kernel_duration
      .Add({{"model", impl_->model_name}, {"op", std::string(op)}}, KernelBucketsSeconds())
      .Observe(seconds);
}

void PrometheusMetrics::SetGpuMemoryUsedBytes(int64_t bytes) {
  impl_->gpu_memory_used.Add(impl_->ModelLabel()).Set(static_cast<double>(bytes));
}

void PrometheusMetrics::SetKernelTimingSampleEvery(int64_t every) {
  impl_->kernel_timing_sample_every.Add(impl_->ModelLabel()).Set(static_cast<double>(every));
}

std::string PrometheusMetrics::Serialize() const {
  std::vector<prometheus::MetricFamily> families = impl_->registry->Collect();
  AppendProcessFamilies(families);
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace layerserve
