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
#include "base/status_macros.h"
#include "server/core/batcher.h"
#include "server/core/observer.h"
#include "server/core/sessions.h"
#include "server/core/stats.h"
#include "server/cpu/cpu_backend.h"
#include "server/grpc/completion_queues.h"
#include "server/grpc/grpc_frontend.h"
#include "server/grpc/served_model.h"
#include "server/memory_trimmer.h"
#include "server/metrics/metrics_http.h"
#include "server/metrics/prometheus_metrics.h"
#include "server/model/model.h"
#include "server/server_flags.h"
#include "server/server_options.h"
#include "server/server_security.h"
#ifdef LAYERSERVE_WITH_CUDA
#include "server/cuda/cuda_backend.h"
#include "server/cuda_backend_flags.h"
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
// The CUDA backend the flags ask for, with its GEMM routes and device memory
// exported to `metrics`. `kernel_times` must outlive the backend.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackendFromFlags(const ServerFlags& flags,
                                                                  const ModelSpan& span,
                                                                  PrometheusMetrics* metrics,
                                                                  KernelTimingSink* kernel_times) {
  LS_ASSIGN_OR_RETURN(const CudaBackendOptions options,
                      CudaBackendOptionsFromFlags(flags, kVersion, kernel_times));
  LS_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> cuda, MakeCudaBackend(span, options));
  metrics->SetKernelTimingSampleEvery(options.timing_sample_every);
  std::vector<GemmRouteInfo> routes;
  for (const cuda::GemmRoute& r : cuda->GemmRoutes()) {
    routes.push_back({.shape = absl::StrCat(r.shape.n, "x", r.shape.k),
                      .gated = r.shape.gated,
                      .precision = cuda::GemmPrecisionName(r.shape.fp8),
                      .m_max = r.m_max,
                      .kernel = r.config});
  }
  metrics->SetGemmRoutes(routes);
  // Nothing is allocated on the request path, so the start-up figure holds.
  if (absl::StatusOr<int64_t> used = cuda->DeviceMemoryUsedBytes(); used.ok()) {
    metrics->SetGpuMemoryUsedBytes(*used);
  }
  return std::unique_ptr<Backend>(std::move(cuda));
}
#endif

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

// Runs `work` (a load of seconds to minutes) on a thread of its own while
// main waits for it or a shutdown signal; a signal first ends the process
// (ExitBeforeReady).
void RunBeforeReady(const sigset_t& signals, absl::FunctionRef<void()> work) {
  absl::Notification done;
  std::thread worker([&] {
    work();
    done.Notify();
  });
  if (const int signal_number =
          WaitForSignalUnless(signals, [&] { return done.HasBeenNotified(); })) {
    ExitBeforeReady(signal_number);
  }
  worker.join();
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

// The KV cache and session table that sessions need, as `plan` sized them,
// or null when sessions are off.
absl::StatusOr<std::unique_ptr<SessionTable>> MakeSessions(const ServerFlags& flags,
                                                           const KvCachePlan& plan,
                                                           Backend& backend) {
  if (!plan.shape) return nullptr;
  LS_RETURN_IF_ERROR(backend.AllocateKvCache(*plan.shape));
  return SessionTable::Create(SessionTableOptionsFromFlags(flags, *plan.shape));
}

int Run(const ServerFlags& flags, const sigset_t& signals) {
  if (absl::Status s = CheckFlags(flags); !s.ok()) return Fail(s);
  // Heap a burst freed (a reset-stream flood, a large load) goes back to the
  // kernel within seconds rather than staying resident (server/memory_trimmer.h).
  const MemoryTrimmer trimmer(kMemoryTrimPeriod, kMemoryTrimGrowthBytes);
  absl::StatusOr<std::string> backend_name = ChooseBackend(flags.backend);
  if (!backend_name.ok()) return Fail(backend_name.status());
  absl::StatusOr<ServerSecurity> security = LoadServerSecurity(flags);
  if (!security.ok()) return Fail(security.status());
  const absl::StatusOr<ModelSource> source = ModelSourceFromFlags(flags);
  if (!source.ok()) return Fail(source.status());
  if (absl::Status s = CheckModel(source->model_dir, source->range); !s.ok()) return Fail(s);

  // The ports first: one in use is found before a load of minutes. The
  // metrics server can serve at once (its gauges read zero until requests
  // come); the gRPC port is only held until the model is loaded (see
  // PortReservation).
  if (IsWildcardHost(flags.host)) {
    LogWarning(absl::StrCat("binding all interfaces (--host=", flags.host,
                            "): the gRPC and metrics ports are reachable from other machines; "
                            "--host=127.0.0.1 keeps them to this one"));
  }
  absl::StatusOr<PortReservation> grpc_port = PortReservation::Reserve(flags.host, flags.grpc_port);
  if (!grpc_port.ok()) return Fail(grpc_port.status());
  PrometheusMetrics metrics(source->model_name);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> metrics_server =
      MetricsHttpServer::Start(flags.host, flags.metrics_port, &metrics, security->metrics);
  if (!metrics_server.ok()) return Fail(metrics_server.status());
  Log(security->Summary());

  Log(absl::StrCat("version ", kVersion, "; loading ", source->Description(flags.layers)));
  absl::StatusOr<ModelSpan> span;
  RunBeforeReady(signals,
                 [&] { span = LoadModel(source->model_dir, source->range, source->model_name); });
  if (!span.ok()) return Fail(span.status());
  Log("model " + span->Summary());
  if (const int64_t window = span->config.SmallestAttentionWindow(
          span->first_layer, static_cast<int64_t>(span->layers.size()));
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
  RunBeforeReady(signals, [&] {
#ifdef LAYERSERVE_WITH_CUDA
    if (*backend_name == "cuda") {
      backend = MakeCudaBackendFromFlags(flags, *span, &metrics, &kernel_times);
    }
#endif
    if (*backend_name == "cpu") backend = MakeCpuBackend(*span, CpuBackendOptionsFromFlags(flags));
  });
  if (!backend.ok()) return Fail(backend.status());

  const absl::StatusOr<KvCachePlan> kv_plan =
      PlanKvCache(flags, *backend_name, (*backend)->KvBlockBytes(flags.kv_block_tokens),
                  (*backend)->KvMemoryAvailable());
  if (!kv_plan.ok()) return Fail(kv_plan.status());
  absl::StatusOr<std::unique_ptr<SessionTable>> sessions = MakeSessions(flags, *kv_plan, **backend);
  if (!sessions.ok()) return Fail(sessions.status());
  Log(kv_plan->Summary(flags));

  const ServedModel served = ServedModelFromFlags(flags, *span, *backend_name, *kv_plan);
  span.value().layers.clear();  // the backend holds its own copy of the weights

  StatsRecorder stats;
  ObserverList observers;
  observers.Add(&stats);
  observers.Add(&metrics);

  const BatcherOptions batcher_options =
      BatcherOptionsFromFlags(flags, served.config.hidden_size, sessions->get());
  Batcher batcher(batcher_options, backend->get(), &observers, SteadyClock::Get());
  metrics.SetBuildInfo(
      {.version = kVersion, .backend = *backend_name, .device = (*backend)->Device()});
  if (served.sessions) {
    metrics.SetKvCache({.block_tokens = served.kv_block_tokens,
                        .blocks = served.kv_blocks,
                        .bytes = served.kv_blocks * kv_plan->block_bytes,
                        .max_sessions = served.max_sessions});
  }
  if (served.config.IsMixtureOfExperts()) {
    metrics.SetExperts(served.first_layer, served.num_layers, served.config.num_experts);
  }
  metrics.SetLimits(ServingLimitsOf(batcher_options));

  const GrpcFrontendOptions grpc_options =
      GrpcFrontendOptionsFromFlags(flags, *security, grpc_port->port(), kVersion);
  grpc_port->Release();  // gRPC binds it next
  RaiseOpenFileLimit();  // before the port accepts its first connection
  absl::StatusOr<std::unique_ptr<GrpcFrontend>> frontend =
      GrpcFrontend::Start(grpc_options, served, &batcher, backend->get(), &observers, &stats);
  if (!frontend.ok()) return Fail(frontend.status());

  Log(ServingSummary(flags, batcher_options, grpc_options, served));
  std::cout << "layerserve ready: model=" << served.name << " layers=" << served.first_layer << ":"
            << served.first_layer + served.num_layers << " backend=" << served.backend
            << " grpc_port=" << (*frontend)->port() << " metrics_port=" << (*metrics_server)->port()
            << std::endl;

  // Wait for SIGTERM/SIGINT, or for gRPC's listener to fail (see
  // GrpcAcceptFailed): then the port takes no new connection ever again, and
  // the right move is the same drain followed by a failing exit, so that a
  // supervisor (Kubernetes, compose's restart policy) starts a fresh server.
  const int signal_number =
      WaitForSignalUnless(signals, [&] { return (*frontend)->AcceptFailed(); });
  const bool listener_failed = signal_number == 0;
  const DrainOptions drain = DrainOptionsFromFlags(flags, served.sessions);
  if (listener_failed) {
    LogError(absl::StrCat(
        "the gRPC port stopped accepting connections (accept failed; see the [grpc] line above: "
        "with too many open files, gRPC 1.51 never listens again); draining for up to ",
        absl::FormatDuration(drain.sessions_timeout + drain.calls_timeout),
        ", then exiting with status 1 to be restarted"));
  } else {
    Log(absl::StrCat("received ", strsignal(signal_number), "; draining for up to ",
                     absl::FormatDuration(drain.sessions_timeout + drain.calls_timeout)));
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
                     absl::FormatDuration(drain.sessions_timeout), " for the ", open,
                     " open to end"));
    const absl::Time sessions_deadline = absl::Now() + drain.sessions_timeout;
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
  const absl::Time deadline = absl::Now() + drain.calls_timeout;
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
