// layerserve: serves a span of Llama decoder layers over gRPC (Open Inference
// Protocol) with Prometheus metrics.
//
// main() parses flags, binds its ports, loads the model (on a thread, so that
// a signal ends a slow load), wires backend -> batcher -> gRPC frontend with
// the statistics and metrics observers, prints one "ready" line on stdout
// (tests and scripts parse its ports), and waits for SIGTERM/SIGINT to drain
// gracefully. It is the only place in the program that exits.
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/log.h"
#include "base/memory_trimmer.h"
#include "base/status_macros.h"
#include "server/core/batcher.h"
#include "server/core/observer.h"
#include "server/core/sessions.h"
#include "server/core/stats.h"
#include "server/cpu/cpu_backend.h"
#include "server/grpc/completion_queues.h"
#include "server/grpc/grpc_frontend.h"
#include "server/grpc/served_model.h"
#include "server/metrics/metrics_http.h"
#include "server/metrics/prometheus_metrics.h"
#include "server/model/model.h"
#include "server_flags.h"
#include "server_security.h"
#ifdef LAYERSERVE_WITH_CUDA
#include "server/cuda/cuda_backend.h"
#endif

namespace layerserve {
namespace {

// The project's version string, from CMake.
#ifndef LAYERSERVE_VERSION
#error "LAYERSERVE_VERSION must be defined by the build"
#endif
constexpr char kVersion[] = LAYERSERVE_VERSION;

// The memory trimmer's check period and the RSS growth that makes it trim.
// After a flood of 300 000 reset streams: 6 GB resident, 0.23 GB after a trim.
constexpr std::chrono::milliseconds kMemoryTrimPeriod{5000};
constexpr int64_t kMemoryTrimGrowthBytes = int64_t{256} << 20;

// The start-up, sessions and drain lines (base/log.h; the format is
// --log-format's). Errors go through Fail, warnings through LogWarning.
void Log(const std::string& line) { LogInfo(line); }

int Fail(const absl::Status& status) {
  LogError(std::string(status.message()));
  return 1;
}

// "cpu" or "cuda". auto picks CUDA when this binary has the CUDA backend and
// the runtime sees a device.
absl::StatusOr<std::string> ChooseBackend(const std::string& flag) {
  if (flag == "cpu") return std::string("cpu");
#ifdef LAYERSERVE_WITH_CUDA
  if (flag == "cuda") return std::string("cuda");
  if (flag == "auto") return std::string(CudaDeviceAvailable() ? "cuda" : "cpu");
#else
  if (flag == "auto") return std::string("cpu");
  if (flag == "cuda") {
    return absl::UnimplementedError(
        "the CUDA backend is not built into this binary (configure with a CUDA toolkit)");
  }
#endif
  return absl::InvalidArgumentError(
      absl::StrCat("--backend=", flag, " is not one of auto, cpu, cuda"));
}

#ifdef LAYERSERVE_WITH_CUDA
// Per-op device times of the CUDA backend's sampled batches, to Prometheus.
class KernelTimesToMetrics final : public KernelTimingSink {
 public:
  explicit KernelTimesToMetrics(PrometheusMetrics* metrics) : metrics_(metrics) {}
  void OnKernelTime(std::string_view op, double seconds) override {
    metrics_->OnKernelTime(op, seconds);
  }

 private:
  PrometheusMetrics* const metrics_;
};
#endif

#ifdef LAYERSERVE_WITH_CUDA
// The CUDA backend the flags ask for, with its device memory exported as a
// gauge. `kernel_times` must outlive the backend.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackendFromFlags(const ServerFlags& flags,
                                                                  const ModelSpan& span,
                                                                  PrometheusMetrics* metrics,
                                                                  KernelTimingSink* kernel_times) {
  CudaBackendOptions options;
  options.device = flags.cuda_device;
  options.num_streams = flags.streams;
  options.cuda_graph_max_tokens = flags.cuda_graph_max_tokens;
  options.warm_up = flags.cuda_warmup;
  options.blocking_wait = flags.cuda_wait == "block";
  options.max_batch_tokens = flags.max_batch_tokens;
  options.timing_sink = kernel_times;
  absl::StatusOr<kernels::GemmMode> gemm_mode = kernels::ParseGemmMode(flags.gemm);
  if (!gemm_mode.ok()) return gemm_mode.status();
  options.gemm_mode = *gemm_mode;
  absl::StatusOr<std::vector<cuda::GemmPin>> pins = cuda::ParseGemmPins(flags.gemm_override);
  if (!pins.ok()) return pins.status();
  if (!pins->empty() && *gemm_mode != kernels::GemmMode::kAuto) {
    return absl::InvalidArgumentError("--gemm-override needs --gemm=auto");
  }
  options.gemm_tuning.autotune = flags.gemm_autotune;
  options.gemm_tuning.cache_path = flags.gemm_tune_cache;
  options.gemm_tuning.build = kVersion;
  options.gemm_tuning.pins = *std::move(pins);
  absl::StatusOr<std::unique_ptr<CudaBackend>> cuda = MakeCudaBackend(span, options);
  if (!cuda.ok()) return cuda.status();
  metrics->SetKernelTimingSampleEvery(options.timing_sample_every);
  std::vector<GemmRouteInfo> routes;
  for (const cuda::GemmRoute& r : (*cuda)->GemmRoutes()) {
    routes.push_back({.shape = absl::StrCat(r.shape.n, "x", r.shape.k),
                      .gated = r.shape.gated,
                      .precision = cuda::GemmPrecisionName(r.shape.fp8),
                      .m_max = r.m_max,
                      .kernel = r.config});
  }
  metrics->SetGemmRoutes(routes);
  // Nothing is allocated on the request path, so the start-up figure holds.
  if (absl::StatusOr<int64_t> used = (*cuda)->DeviceMemoryUsedBytes(); used.ok()) {
    metrics->SetGpuMemoryUsedBytes(*used);
  }
  return std::unique_ptr<Backend>(std::move(*cuda));
}
#endif

std::string DefaultModelName(const std::string& model_dir) {
  if (model_dir.empty()) return "demo";
  std::filesystem::path path(model_dir);
  if (!path.has_filename()) path = path.parent_path();  // "dir/" names "dir"
  const std::string name = path.filename().string();
  return name.empty() ? "model" : name;
}

// The model's config and the layer range against it, before a port is bound
// or a line logged: a wrong directory or range is start-up's only line. The
// demo cannot fail to build and clamps its range, so its range is checked here.
absl::Status CheckModel(const std::string& model_dir, const LayerRange& range) {
  if (!model_dir.empty()) return ReadModelConfig(model_dir, range).status();
  const int64_t layers = DemoConfig().num_hidden_layers;
  const int64_t begin = range.begin.value_or(0);
  const int64_t end = range.end.value_or(layers);
  if (begin < 0 || end > layers || begin >= end) {
    return absl::InvalidArgumentError(absl::StrCat("layer range [", begin, ", ", end,
                                                   ") is empty or outside the ", layers,
                                                   " layers of the demo model"));
  }
  return absl::OkStatus();
}

// The span `range` of the checkpoint in `model_dir` (or of the demo model),
// after CheckModel.
absl::StatusOr<ModelSpan> LoadModel(const std::string& model_dir, const LayerRange& range,
                                    const std::string& name) {
  if (!model_dir.empty()) return LoadModelSpan(model_dir, range, name);
  return MakeDemoModel(range, name);
}

pthread_t main_thread;

// The shutdown signals, blocked before anything else of the program runs:
// the executable's .preinit_array runs before the initializers of the shared
// libraries (OpenBLAS starts its thread pool in its own), and every thread
// inherits the mask, so a SIGTERM in the first milliseconds stays pending
// until main takes it instead of killing the process by default. Only the
// dynamic loader's own relocation (about a millisecond) comes earlier.
void BlockShutdownSignalsFirst(int, char**, char**) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigprocmask(SIG_BLOCK, &signals, nullptr);
}
[[gnu::used, gnu::section(".preinit_array")]] void (*const kBlockShutdownSignalsFirst)(
    int, char**, char**) = &BlockShutdownSignalsFirst;

// Runs on a thread that did not block the shutdown signals. Re-sends the
// signal to the main thread, where it stays pending until sigwait takes it.
// (pthread_kill is a single tgkill system call: safe in a handler.)
void ForwardToMainThread(int signal_number) { pthread_kill(main_thread, signal_number); }

// Blocks SIGTERM and SIGINT in this thread (again: see
// BlockShutdownSignalsFirst) and, because threads inherit the mask, in every
// thread started after it (gRPC, batcher, metrics, the loader), so that only
// main's sigwait sees them. Should a thread have them unblocked anyway (one a
// library started with a mask of its own), the kernel may deliver a
// process-directed signal to it, and the default action would kill the
// process without draining, so a handler forwards it to the main thread.
sigset_t BlockShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  main_thread = pthread_self();
  struct sigaction action = {};
  action.sa_handler = ForwardToMainThread;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

// How often main looks at what it waits for besides a signal (sigtimedwait
// cannot also wait on a notification or a flag).
constexpr timespec kSignalPoll = {.tv_sec = 0, .tv_nsec = 50'000'000};

// Waits until `done()` returns true or one of `signals` arrives: the signal's
// number, or 0 once `done()`. Polls every kSignalPoll.
int WaitForSignalUnless(const sigset_t& signals, absl::FunctionRef<bool()> done) {
  while (!done()) {
    const int signal_number = sigtimedwait(&signals, nullptr, &kSignalPoll);
    if (signal_number > 0) return signal_number;
  }
  return 0;
}

// A shutdown signal before the server is ready ends the process at once
// with status 0, as a drain would: nothing was being served, and a load (or
// a device set-up) that hangs must not keep the process alive. _Exit, since
// the loading thread may still be running and use what destructors would
// free.
[[noreturn]] void ExitBeforeReady(int signal_number) {
  Log(absl::StrCat("received ", strsignal(signal_number),
                   " before the server was ready; exiting without serving"));
  std::fflush(nullptr);
  std::_Exit(0);
}

// Lifts the soft limit on open files to the hard one and says so. Each gRPC
// connection holds a descriptor, and when gRPC 1.51 runs out of them its
// listener stops for good (GrpcFrontend::AcceptFailed): at the usual soft
// limit of 1024, a thousand idle sockets from one client would take the port
// down. (Nothing here uses select(), which cannot take descriptors past 1023.)
void RaiseOpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const rlim_t before = limit.rlim_cur;
  // An unlimited hard limit still stops at the kernel's fs.nr_open (2^20 by
  // default), and setrlimit refuses more.
  const rlim_t target = limit.rlim_max == RLIM_INFINITY ? rlim_t{1} << 20 : limit.rlim_max;
  if (before < target) {
    limit.rlim_cur = target;
    if (setrlimit(RLIMIT_NOFILE, &limit) == 0) {
      Log(absl::StrCat("open files: soft limit raised from ", before, " to ", target));
      return;
    }
  }
  Log(absl::StrCat(
      "open files: limit ", before,
      before < 4096 ? " (low: every gRPC connection takes one; raise the hard limit)" : ""));
}

// The KV cache and session table that sessions need, sized by the flags, or
// null when sessions are off (the backend keeps no KV cache, or
// --kv-cache-memory=0). Logs what it chose.
absl::StatusOr<std::unique_ptr<SessionTable>> MakeSessions(const ServerFlags& flags,
                                                           Backend& backend,
                                                           const std::string& backend_name) {
  const int64_t block_bytes = backend.KvBlockBytes(flags.kv_block_tokens);
  if (block_bytes <= 0) {
    Log(absl::StrCat("sessions: off (the ", backend_name,
                     " backend keeps no KV cache yet); requests with a sequence_id are refused"));
    return nullptr;
  }
  // auto: for the CUDA backend 0.9 of what the device has free after the
  // weights and arenas (less a reserve the backend keeps back); for the CPU
  // backend a quarter of the host's available memory, whose pages are taken
  // only as sessions fill them.
  const double auto_fraction = backend_name == "cuda" ? 0.9 : 0.25;
  const int64_t available = backend.KvMemoryAvailable();
  LS_ASSIGN_OR_RETURN(const int64_t bytes,
                      KvCacheBytes(flags.kv_cache_memory, available, auto_fraction));
  if (bytes == 0 && flags.kv_cache_memory == "0") {
    Log("sessions: off (--kv-cache-memory=0)");
    return nullptr;
  }
  const int64_t blocks = std::min<int64_t>(bytes / block_bytes, INT32_MAX);
  if (blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-memory=", flags.kv_cache_memory, " gives ", bytes,
                     " bytes, less than one KV cache block of ", flags.kv_block_tokens, " tokens (",
                     block_bytes, " bytes for this span)"));
  }
  const KvCacheShape shape{.num_blocks = static_cast<int32_t>(blocks),
                           .block_tokens = flags.kv_block_tokens};
  LS_RETURN_IF_ERROR(backend.AllocateKvCache(shape));
  SessionTableOptions options;
  options.num_blocks = shape.num_blocks;
  options.block_tokens = shape.block_tokens;
  options.max_sessions = flags.max_sessions;
  options.max_session_tokens = flags.max_session_tokens;
  options.idle_timeout = std::chrono::seconds(flags.session_idle_timeout_s);
  LS_ASSIGN_OR_RETURN(std::unique_ptr<SessionTable> table, SessionTable::Create(options));
  const double mib = static_cast<double>(blocks * block_bytes) / (1 << 20);
  Log(absl::StrCat("sessions: KV cache of ", blocks, " blocks x ", flags.kv_block_tokens,
                   " tokens = ", blocks * flags.kv_block_tokens, " tokens in ",
                   absl::StrFormat("%.1f", mib), " MiB (", block_bytes / flags.kv_block_tokens,
                   " bytes per token; --kv-cache-memory=", flags.kv_cache_memory, " of ", available,
                   " bytes available); max_sessions=", flags.max_sessions,
                   " max_session_tokens=", flags.max_session_tokens,
                   " session_idle_timeout_s=", flags.session_idle_timeout_s));
  return table;
}

int Run(const ServerFlags& flags, const sigset_t& signals) {
  if (absl::Status s = CheckFlags(flags); !s.ok()) return Fail(s);
  // Heap a burst freed (a reset-stream flood, a large load) goes back to the
  // kernel within seconds rather than staying resident (base/memory_trimmer.h).
  const MemoryTrimmer trimmer(kMemoryTrimPeriod, kMemoryTrimGrowthBytes);
  absl::StatusOr<std::string> backend_name = ChooseBackend(flags.backend);
  if (!backend_name.ok()) return Fail(backend_name.status());
  absl::StatusOr<ServerSecurity> security = LoadServerSecurity(flags);
  if (!security.ok()) return Fail(security.status());

  const std::string model_dir = flags.model_dir;
  std::string model_name = flags.model_name;
  if (model_name.empty()) model_name = DefaultModelName(model_dir);
  // CheckFlags checked the range's syntax.
  const absl::StatusOr<LayerRange> range = ParseLayerRange(flags.layers);
  if (!range.ok()) return Fail(range.status());
  if (absl::Status s = CheckModel(model_dir, *range); !s.ok()) return Fail(s);

  // The ports first: one in use is found before a load of minutes. The
  // metrics server can serve at once (its gauges read zero until requests
  // come); the gRPC port is only held until the model is loaded (see
  // PortReservation).
  const std::string host = flags.host;
  if (IsWildcardHost(host)) {
    LogWarning(absl::StrCat("binding all interfaces (--host=", host,
                            "): the gRPC and metrics ports are reachable from other machines; "
                            "--host=127.0.0.1 keeps them to this one"));
  }
  absl::StatusOr<PortReservation> grpc_port = PortReservation::Reserve(host, flags.grpc_port);
  if (!grpc_port.ok()) return Fail(grpc_port.status());
  PrometheusMetrics metrics(model_name);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> metrics_server =
      MetricsHttpServer::Start(host, flags.metrics_port, &metrics, security->metrics);
  if (!metrics_server.ok()) return Fail(metrics_server.status());
  Log(security->Summary());

  Log(absl::StrCat("version ", kVersion, "; loading ",
                   model_dir.empty() ? std::string("the built-in demo model") : model_dir,
                   flags.layers.empty() || flags.layers == ":" ? std::string(", all layers")
                                                               : " layers " + flags.layers));
  absl::StatusOr<ModelSpan> span;
  absl::Notification span_loaded;
  std::thread span_loader([&] {
    span = LoadModel(model_dir, *range, model_name);
    span_loaded.Notify();
  });
  if (const int signal_number =
          WaitForSignalUnless(signals, [&] { return span_loaded.HasBeenNotified(); })) {
    ExitBeforeReady(signal_number);
  }
  span_loader.join();
  if (!span.ok()) return Fail(span.status());
  const int64_t first_layer = span->first_layer;
  const int64_t end_layer = first_layer + static_cast<int64_t>(span->layers.size());
  Log("model " + span->Summary());
  if (const int64_t window =
          span->config.SmallestAttentionWindow(first_layer, end_layer - first_layer);
      window > 0) {
    Log(absl::StrCat("sliding-window attention: window ", window,
                     " tokens in some or all of the served layers"));
  }

#ifdef LAYERSERVE_WITH_CUDA
  KernelTimesToMetrics kernel_times(&metrics);  // declared first: outlives the backend
#endif
  // The backend copies (and for CUDA, uploads and tunes) the weights: seconds
  // for a large span, so it too runs on a thread that a signal does not wait
  // for.
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      absl::InvalidArgumentError(absl::StrCat("no backend ", *backend_name));
  absl::Notification backend_made;
  std::thread backend_maker([&] {
#ifdef LAYERSERVE_WITH_CUDA
    if (*backend_name == "cuda") {
      backend = MakeCudaBackendFromFlags(flags, *span, &metrics, &kernel_times);
    }
#endif
    if (*backend_name == "cpu") {
      CpuBackendOptions options;
      options.num_threads = flags.cpu_threads;
      backend = MakeCpuBackend(*span, options);
    }
    backend_made.Notify();
  });
  if (const int signal_number =
          WaitForSignalUnless(signals, [&] { return backend_made.HasBeenNotified(); })) {
    ExitBeforeReady(signal_number);
  }
  backend_maker.join();
  if (!backend.ok()) return Fail(backend.status());

  absl::StatusOr<std::unique_ptr<SessionTable>> sessions =
      MakeSessions(flags, **backend, *backend_name);
  if (!sessions.ok()) return Fail(sessions.status());

  ServedModel served;
  served.name = span->name;
  served.config = span->config;
  served.first_layer = first_layer;
  served.num_layers = end_layer - first_layer;
  served.backend = *backend_name;
  served.max_batch_tokens = flags.max_batch_tokens;
  served.max_queue_delay_us = flags.max_queue_delay_us;
  served.max_queue_size = flags.max_queue_size;
  if (*sessions == nullptr) {
    served.sessions_off_reason =
        (*backend)->KvBlockBytes(flags.kv_block_tokens) > 0
            ? "--kv-cache-memory=0"
            : absl::StrCat("the ", *backend_name, " backend keeps no KV cache yet");
  } else {
    const SessionTableOptions& options = (*sessions)->options();
    served.sessions = true;
    served.kv_block_tokens = options.block_tokens;
    served.kv_blocks = options.num_blocks;
    served.max_sessions = options.max_sessions;
    served.max_session_tokens = options.max_session_tokens;
    served.session_idle_timeout_us = flags.session_idle_timeout_s * 1'000'000;
  }
  span.value().layers.clear();  // the backend holds its own copy of the weights

  StatsRecorder stats;
  ObserverList observers;
  observers.Add(&stats);
  observers.Add(&metrics);

  BatcherOptions batcher_options;
  batcher_options.policy.max_batch_tokens = served.max_batch_tokens;
  batcher_options.policy.max_queue_delay = std::chrono::microseconds(served.max_queue_delay_us);
  batcher_options.policy.delay_when_idle = flags.batch_delay_when_idle;
  batcher_options.policy.max_device_wait = std::chrono::microseconds(flags.max_device_wait_us);
  batcher_options.policy.device_lead = std::chrono::microseconds(flags.device_lead_us);
  batcher_options.max_queue_size = served.max_queue_size;
  batcher_options.reply_threads = flags.reply_threads;
  batcher_options.max_queue_bytes =
      flags.max_queue_bytes > 0
          ? flags.max_queue_bytes
          : DefaultMaxQueueBytes(batcher_options.policy, served.config.hidden_size);
  batcher_options.sessions = sessions->get();
  batcher_options.prefill_chunk_tokens = flags.prefill_chunk_tokens;
  Batcher batcher(batcher_options, backend->get(), &observers, SteadyClock::Get());
  metrics.SetBuildInfo(
      {.version = kVersion, .backend = *backend_name, .device = (*backend)->Device()});
  if (*sessions != nullptr) {
    metrics.SetKvCache(
        {.block_tokens = served.kv_block_tokens,
         .blocks = served.kv_blocks,
         .bytes = served.kv_blocks * (*backend)->KvBlockBytes(served.kv_block_tokens),
         .max_sessions = served.max_sessions});
  }
  if (served.config.IsMixtureOfExperts()) {
    metrics.SetExperts(served.first_layer, served.num_layers, served.config.num_experts);
  }
  metrics.SetLimits(
      {.max_queue_size = served.max_queue_size,
       .max_queue_bytes = batcher_options.max_queue_bytes,
       .max_batch_tokens = served.max_batch_tokens,
       .max_queue_delay_seconds = static_cast<double>(served.max_queue_delay_us) * 1e-6});

  GrpcFrontendOptions grpc_options;
  grpc_options.host = host;
  grpc_options.port = grpc_port->port();
  grpc_port->Release();  // gRPC binds it next
  grpc_options.server_version = kVersion;
  grpc_options.max_connection_age_s = flags.grpc_max_connection_age_s;
  grpc_options.max_connection_idle_s = flags.grpc_max_connection_idle_s;
  grpc_options.queue_threads = flags.grpc_threads > 0 ? flags.grpc_threads : DefaultQueueThreads();
  grpc_options.max_connection_age_grace_s = flags.drain_timeout_s;
  grpc_options.tls = security->grpc_tls;
  grpc_options.auth_token = security->auth_token;
  grpc_options.auth_open = security->auth_open;
  RaiseOpenFileLimit();  // before the port accepts its first connection
  absl::StatusOr<std::unique_ptr<GrpcFrontend>> frontend =
      GrpcFrontend::Start(grpc_options, served, &batcher, backend->get(), &observers, &stats);
  if (!frontend.ok()) return Fail(frontend.status());

  Log(absl::StrCat(
      "max_batch_tokens=", served.max_batch_tokens,
      " max_queue_delay_us=", served.max_queue_delay_us,
      batcher_options.policy.delay_when_idle ? " (also when idle)" : " (while busy)",
      " max_device_wait_us=", flags.max_device_wait_us, " device_lead_us=", flags.device_lead_us,
      " max_queue_size=", served.max_queue_size,
      " max_queue_bytes=", batcher_options.max_queue_bytes, " cpu_threads=", flags.cpu_threads,
      " streams=", flags.streams, " max_message_bytes=", DefaultMaxMessageBytes(served),
      " grpc_threads=", grpc_options.queue_threads, " reply_threads=", flags.reply_threads,
      " drain_timeout_s=", flags.drain_timeout_s,
      " drain_sessions_timeout_s=", flags.drain_sessions_timeout_s));
  std::cout << "layerserve ready: model=" << served.name << " layers=" << first_layer << ":"
            << end_layer << " backend=" << served.backend << " grpc_port=" << (*frontend)->port()
            << " metrics_port=" << (*metrics_server)->port() << std::endl;

  // Wait for SIGTERM/SIGINT, or for gRPC's listener to fail (see
  // GrpcAcceptFailed): then the port takes no new connection ever again, and
  // the right move is the same drain followed by a failing exit, so that a
  // supervisor (Kubernetes, compose's restart policy) starts a fresh server.
  const int signal_number =
      WaitForSignalUnless(signals, [&] { return (*frontend)->AcceptFailed(); });
  const bool listener_failed = signal_number == 0;
  const absl::Duration drain_timeout = absl::Seconds(flags.drain_timeout_s);
  const absl::Duration sessions_timeout =
      absl::Seconds(*sessions != nullptr ? flags.drain_sessions_timeout_s : 0);
  if (listener_failed) {
    LogError(absl::StrCat(
        "the gRPC port stopped accepting connections (accept failed; see the [grpc] line above: "
        "with too many open files, gRPC 1.51 never listens again); draining for up to ",
        absl::FormatDuration(sessions_timeout + drain_timeout),
        ", then exiting with status 1 to be restarted"));
  } else {
    Log(absl::StrCat("received ", strsignal(signal_number), "; draining for up to ",
                     absl::FormatDuration(sessions_timeout + drain_timeout)));
  }

  // Readiness goes false first so load balancers stop sending, and new work
  // is refused, but the steps of open sessions are still taken
  // (server/core/drain.h): their KV caches are here only. Once every session
  // has ended, or --drain-sessions-timeout-s has passed, the rest are
  // dropped; then the batcher runs everything already queued, and the gRPC
  // server waits for open calls (streams) until the deadline. A backend that
  // never returns must not keep the process alive, so main waits with the
  // deadline and leaves without cleanup if it passes; a second signal leaves
  // at once.
  (*frontend)->BeginDrain();
  if (*sessions != nullptr) {
    SessionTable& table = **sessions;
    const int64_t open = table.Stats().sessions_open;
    Log(absl::StrCat("drain: no new sessions; waiting up to ",
                     absl::FormatDuration(sessions_timeout), " for the ", open, " open to end"));
    const absl::Time sessions_deadline = absl::Now() + sessions_timeout;
    // Requests queued before the signal (a sequence_start among them) are
    // still to open their sessions: the phase lasts until they have run.
    const int second_signal = WaitForSignalUnless(signals, [&] {
      return (table.Stats().sessions_open == 0 && batcher.queue_depth() == 0) ||
             absl::Now() >= sessions_deadline;
    });
    if (second_signal > 0) {
      Log("second signal; exiting without finishing the drain");
      std::fflush(nullptr);
      std::_Exit(1);
    }
    const int64_t still_open = table.Stats().sessions_open;
    // Sessions with a step running are dropped as it finishes.
    table.DropForDrain();
    observers.OnSessions(table.Stats());
    Log(absl::StrCat(
        "drain: sessions dropped: ", still_open, " (", open, " were open at the signal)",
        still_open > 0 ? "; a later step of one gets NOT_FOUND: dropped by a drain" : ""));
  }
  const absl::Time deadline = absl::Now() + drain_timeout;
  absl::Notification drained;
  std::thread drainer([&] {
    batcher.Shutdown();
    (*frontend)->Shutdown(deadline);
    (*metrics_server)->Stop();
    drained.Notify();
  });
  while (!drained.HasBeenNotified()) {
    if (sigtimedwait(&signals, nullptr, &kSignalPoll) > 0) {
      Log("second signal; exiting without finishing the drain");
      std::fflush(nullptr);
      std::_Exit(1);
    }
    // One extra second lets the gRPC server's own deadline act first.
    if (absl::Now() > deadline + absl::Seconds(1)) {
      Log("drain timeout passed with work still running; exiting without finishing it");
      std::fflush(nullptr);
      std::_Exit(1);
    }
  }
  drainer.join();
  Log("drained; exiting");
  return listener_failed ? 1 : 0;
}

}  // namespace
}  // namespace layerserve

int main(int argc, char** argv) {
  // Before anything that could take time: a signal during flag parsing stays
  // pending until Run takes it.
  const sigset_t signals = layerserve::BlockShutdownSignals();
  // Debian's Abseil is built without NDEBUG, so by default every absl::Mutex
  // lock (gRPC's own included, several per call) also updates a global
  // lock-order graph to detect deadlocks: a few percent of the server's CPU
  // under load (GraphCycles in a profile). The ThreadSanitizer build of the
  // tests checks lock order instead; the server does not pay for it. Design
  // record 0013.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  layerserve::ServerFlags flags;
  if (const std::optional<int> exit_status =
          layerserve::ParseCommandLine(argc, argv, layerserve::kVersion, flags)) {
    return *exit_status;
  }
  // CheckFlags (in Run) refuses a bad --log-format, in text.
  layerserve::SetLogFormat(
      layerserve::ParseLogFormat(flags.log_format).value_or(layerserve::LogFormat::kText));
  return layerserve::Run(flags, signals);
}
