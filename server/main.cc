// layerserve: serves a span of Llama decoder layers over gRPC (Open Inference
// Protocol) with Prometheus metrics.
//
// main() parses flags, loads the model, wires backend -> batcher -> gRPC
// frontend with the statistics and metrics observers, prints one "ready" line
// on stdout (tests and scripts parse its ports), and waits for SIGTERM/SIGINT
// to drain gracefully. It is the only place in the program that exits.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/core/batcher.h"
#include "server/core/observer.h"
#include "server/core/stats.h"
#include "server/cpu/cpu_backend.h"
#include "server/grpc/grpc_frontend.h"
#include "server/grpc/served_model.h"
#include "server/metrics/prometheus_metrics.h"
#include "server/model/model.h"
#ifdef LAYERSERVE_WITH_CUDA
#include "server/cuda/cuda_backend.h"
#endif

ABSL_FLAG(std::string, model_dir, "",
          "Hugging Face checkpoint directory (config.json + safetensors); empty serves the "
          "built-in demo model");
ABSL_FLAG(std::string, model_name, "",
          "name clients address the model by; default: the directory's name, or \"demo\"");
ABSL_FLAG(std::string, layers, ":",
          "half-open layer range A:B to serve (\":4\", \"2:\", \":\" = all)");
ABSL_FLAG(std::string, host, "0.0.0.0", "address the gRPC and metrics servers bind");
ABSL_FLAG(int, grpc_port, 8001, "gRPC port (0 picks a free one)");
ABSL_FLAG(int, metrics_port, 8002, "Prometheus /metrics HTTP port (0 picks a free one)");
ABSL_FLAG(std::string, backend, "auto", "compute backend: auto, cpu or cuda");
ABSL_FLAG(int64_t, max_batch_tokens, 8192,
          "most tokens (sum of B*T) in one batch; also the per-request limit");
ABSL_FLAG(int64_t, max_queue_delay_us, 500,
          "longest time the oldest queued request waits for a batch to fill");
ABSL_FLAG(int64_t, max_queue_size, 1024,
          "most requests waiting; beyond it ModelInfer fails with RESOURCE_EXHAUSTED");
ABSL_FLAG(int, cpu_threads, 0, "CPU backend threads (0 = all cores)");
ABSL_FLAG(int, streams, 2, "CUDA backend: CUDA streams, i.e. batches in flight at once");
ABSL_FLAG(int, cuda_device, 0, "CUDA backend: device ordinal");
ABSL_FLAG(std::string, gemm, "auto",
          "CUDA backend GEMMs: auto (per shape, the project's kernels where measured faster), "
          "cublaslt, or custom (the project's kernels wherever they apply)");
ABSL_FLAG(bool, gemm_autotune, true,
          "CUDA backend, --gemm=auto: time our GEMM kernels against cuBLASLt for the model's "
          "shapes at load (3.5 s for a Llama-3-8B layer on an H100) and use the faster per "
          "token-count bucket; "
          "off: built-in defaults");
ABSL_FLAG(std::string, gemm_tune_cache, "",
          "CUDA backend, --gemm=auto: JSON file keeping the autotune results between starts "
          "(read if it matches this device, driver and version; written after tuning)");
ABSL_FLAG(std::string, gemm_override, "",
          "CUDA backend, --gemm=auto: pin choices, M:NxK=CONFIG[,...] with CONFIG one of v0 "
          "(cuBLASLt), v3, v3b128, v3b256, v4, v4s1..v4s8, v5; e.g. 16:6144x4096=v0");
ABSL_FLAG(int, drain_timeout_s, 30,
          "on SIGTERM/SIGINT, how long queued and open calls may take to finish");

namespace layerserve {
namespace {

// The project's version string, from CMake.
#ifndef LAYERSERVE_VERSION
#error "LAYERSERVE_VERSION must be defined by the build"
#endif
constexpr char kVersion[] = LAYERSERVE_VERSION;

// Abseil flag names are identifiers; the documented spelling uses dashes
// (--grpc-port). Rewrites the name part of each "--flag[=value]" argument, up
// to a bare "--", so both spellings work.
std::vector<std::string> UnderscoreFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    if (arg == "--") break;
    if (arg.size() < 3 || arg[0] != '-') continue;
    const size_t name_begin = arg[1] == '-' ? 2 : 1;
    const size_t name_end = std::min(arg.find('='), arg.size());
    for (size_t c = name_begin; c < name_end; ++c) {
      if (arg[c] == '-') arg[c] = '_';
    }
  }
  return args;
}

void Log(const std::string& line) { std::cerr << "layerserve: " << line << std::endl; }

int Fail(const absl::Status& status) {
  std::cerr << "layerserve: error: " << status.message() << std::endl;
  return 1;
}

absl::Status CheckFlags() {
  if (absl::GetFlag(FLAGS_max_batch_tokens) <= 0) {
    return absl::InvalidArgumentError("--max-batch-tokens must be >= 1");
  }
  if (absl::GetFlag(FLAGS_max_queue_delay_us) < 0) {
    return absl::InvalidArgumentError("--max-queue-delay-us must be >= 0");
  }
  if (absl::GetFlag(FLAGS_max_queue_size) <= 0 ||
      absl::GetFlag(FLAGS_max_queue_size) > int64_t{UINT32_MAX}) {
    return absl::InvalidArgumentError("--max-queue-size must be in [1, 4294967295]");
  }
  for (const int port : {absl::GetFlag(FLAGS_grpc_port), absl::GetFlag(FLAGS_metrics_port)}) {
    if (port < 0 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("port ", port, " is outside [0, 65535]"));
    }
  }
  if (absl::GetFlag(FLAGS_streams) < 1) {
    return absl::InvalidArgumentError("--streams must be >= 1");
  }
  if (absl::GetFlag(FLAGS_cpu_threads) < 0) {
    return absl::InvalidArgumentError("--cpu-threads must be >= 0");
  }
  if (absl::GetFlag(FLAGS_drain_timeout_s) < 0) {
    return absl::InvalidArgumentError("--drain-timeout-s must be >= 0");
  }
  return absl::OkStatus();
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
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackendFromFlags(
    const ModelSpan& span, PrometheusMetrics* metrics, KernelTimingSink* kernel_times) {
  CudaBackendOptions options;
  options.device = absl::GetFlag(FLAGS_cuda_device);
  options.num_streams = absl::GetFlag(FLAGS_streams);
  options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.timing_sink = kernel_times;
  absl::StatusOr<cuda::GemmMode> gemm_mode = cuda::ParseGemmMode(absl::GetFlag(FLAGS_gemm));
  if (!gemm_mode.ok()) return gemm_mode.status();
  options.gemm_mode = *gemm_mode;
  absl::StatusOr<std::vector<cuda::GemmPin>> pins =
      cuda::ParseGemmPins(absl::GetFlag(FLAGS_gemm_override));
  if (!pins.ok()) return pins.status();
  if (!pins->empty() && *gemm_mode != cuda::GemmMode::kAuto) {
    return absl::InvalidArgumentError("--gemm-override needs --gemm=auto");
  }
  options.gemm_tuning.autotune = absl::GetFlag(FLAGS_gemm_autotune);
  options.gemm_tuning.cache_path = absl::GetFlag(FLAGS_gemm_tune_cache);
  options.gemm_tuning.build = kVersion;
  options.gemm_tuning.pins = *std::move(pins);
  absl::StatusOr<std::unique_ptr<CudaBackend>> cuda = MakeCudaBackend(span, options);
  if (!cuda.ok()) return cuda.status();
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

absl::StatusOr<ModelSpan> LoadModel(const std::string& model_dir, const std::string& name) {
  absl::StatusOr<LayerRange> range = ParseLayerRange(absl::GetFlag(FLAGS_layers));
  if (!range.ok()) return range.status();
  if (!model_dir.empty()) return LoadModelSpan(model_dir, *range, name);
  // The demo cannot fail to build and clamps its range, so check it here.
  const int64_t layers = DemoConfig().num_hidden_layers;
  const int64_t begin = range->begin.value_or(0);
  const int64_t end = range->end.value_or(layers);
  if (begin < 0 || end > layers || begin >= end) {
    return absl::InvalidArgumentError(absl::StrCat("layer range [", begin, ", ", end,
                                                   ") is empty or outside the ", layers,
                                                   " layers of the demo model"));
  }
  return MakeDemoModel(*range, name);
}

pthread_t main_thread;

// Runs on a thread that did not block the shutdown signals. Re-sends the
// signal to the main thread, where it stays pending until sigwait takes it.
// (pthread_kill is a single tgkill system call: safe in a handler.)
void ForwardToMainThread(int signal_number) { pthread_kill(main_thread, signal_number); }

// Blocks SIGTERM and SIGINT in this thread and, because threads inherit the
// mask, in every thread started after it (gRPC, batcher, metrics), so that
// only main's sigwait sees them. Threads that libraries started before main
// (OpenBLAS starts its pool when it is loaded) still have them unblocked: the
// kernel may deliver a process-directed signal to one of those, and the
// default action would kill the process without draining, so a handler
// forwards it to the main thread instead.
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

int Run() {
  const sigset_t signals = BlockShutdownSignals();
  if (absl::Status s = CheckFlags(); !s.ok()) return Fail(s);
  absl::StatusOr<std::string> backend_name = ChooseBackend(absl::GetFlag(FLAGS_backend));
  if (!backend_name.ok()) return Fail(backend_name.status());

  const std::string model_dir = absl::GetFlag(FLAGS_model_dir);
  std::string model_name = absl::GetFlag(FLAGS_model_name);
  if (model_name.empty()) model_name = DefaultModelName(model_dir);
  Log(absl::StrCat("version ", kVersion, "; loading ",
                   model_dir.empty() ? std::string("the built-in demo model") : model_dir,
                   " layers ", absl::GetFlag(FLAGS_layers)));
  absl::StatusOr<ModelSpan> span = LoadModel(model_dir, model_name);
  if (!span.ok()) return Fail(span.status());
  const int64_t first_layer = span->first_layer;
  const int64_t end_layer = first_layer + static_cast<int64_t>(span->layers.size());
  Log(absl::StrCat("model ", span->name, " (", span->config.model_type, ", hidden ",
                   span->config.hidden_size, ", ", span->config.num_attention_heads, " heads, ",
                   span->config.num_key_value_heads, " kv heads) layers ", first_layer, ":",
                   end_layer, ", ", span->WeightBytes(), " weight bytes"));
  if (const int64_t window = span->config.SmallestAttentionWindow(
          first_layer, end_layer - first_layer);
      window > 0) {
    Log(absl::StrCat("sliding-window attention: window ", span->config.sliding_window,
                     " tokens in some or all of the served layers"));
  }

  PrometheusMetrics metrics(span->name);
#ifdef LAYERSERVE_WITH_CUDA
  KernelTimesToMetrics kernel_times(&metrics);  // declared first: outlives the backend
#endif
  absl::StatusOr<std::unique_ptr<Backend>> backend;
#ifdef LAYERSERVE_WITH_CUDA
  if (*backend_name == "cuda") backend = MakeCudaBackendFromFlags(*span, &metrics, &kernel_times);
#endif
  if (*backend_name == "cpu") {
    CpuBackendOptions options;
    options.num_threads = absl::GetFlag(FLAGS_cpu_threads);
    backend = MakeCpuBackend(*span, options);
  }
  if (!backend.ok()) return Fail(backend.status());
  if (const Backend::SequenceLimit limit = (*backend)->MaxSequence(); limit.max_tokens > 0) {
    Log(absl::StrCat("sequences longer than ", limit.max_tokens, " tokens are refused: ",
                     limit.reason));
  }

  ServedModel served;
  served.name = span->name;
  served.config = span->config;
  served.first_layer = first_layer;
  served.num_layers = end_layer - first_layer;
  served.backend = *backend_name;
  served.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  served.max_queue_delay_us = absl::GetFlag(FLAGS_max_queue_delay_us);
  served.max_queue_size = absl::GetFlag(FLAGS_max_queue_size);
  const Backend::SequenceLimit sequence_limit = (*backend)->MaxSequence();
  served.max_sequence_tokens = sequence_limit.max_tokens;
  served.sequence_limit_reason = sequence_limit.reason;
  span.value().layers.clear();  // the backend holds its own copy of the weights

  StatsRecorder stats;
  ObserverList observers;
  observers.Add(&stats);
  observers.Add(&metrics);

  BatcherOptions batcher_options;
  batcher_options.policy.max_batch_tokens = served.max_batch_tokens;
  batcher_options.policy.max_queue_delay = std::chrono::microseconds(served.max_queue_delay_us);
  batcher_options.max_queue_size = served.max_queue_size;
  Batcher batcher(batcher_options, backend->get(), &observers, SteadyClock::Get());

  const std::string host = absl::GetFlag(FLAGS_host);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> metrics_server =
      MetricsHttpServer::Start(host, absl::GetFlag(FLAGS_metrics_port), &metrics);
  if (!metrics_server.ok()) return Fail(metrics_server.status());

  GrpcFrontendOptions grpc_options;
  grpc_options.host = host;
  grpc_options.port = absl::GetFlag(FLAGS_grpc_port);
  grpc_options.server_version = kVersion;
  absl::StatusOr<std::unique_ptr<GrpcFrontend>> frontend =
      GrpcFrontend::Start(grpc_options, served, &batcher, backend->get(), &observers, &stats);
  if (!frontend.ok()) return Fail(frontend.status());

  Log(absl::StrCat("max_batch_tokens=", served.max_batch_tokens, " max_queue_delay_us=",
                   served.max_queue_delay_us, " max_queue_size=", served.max_queue_size,
                   " cpu_threads=", absl::GetFlag(FLAGS_cpu_threads), " streams=", absl::GetFlag(FLAGS_streams),
                   " max_message_bytes=", DefaultMaxMessageBytes(served),
                   " drain_timeout_s=", absl::GetFlag(FLAGS_drain_timeout_s)));
  std::cout << "layerserve ready: model=" << served.name << " layers=" << first_layer << ":"
            << end_layer << " backend=" << served.backend << " grpc_port=" << (*frontend)->port()
            << " metrics_port=" << (*metrics_server)->port() << std::endl;

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  const absl::Duration drain_timeout = absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s));
  const absl::Time deadline = absl::Now() + drain_timeout;
  Log(absl::StrCat("received ", strsignal(signal_number), "; draining for up to ",
                   absl::FormatDuration(drain_timeout)));

  // Readiness goes false first so load balancers stop sending; the batcher
  // then runs everything already queued, and the gRPC server waits for open
  // calls (streams) until the deadline. A backend that never returns must not
  // keep the process alive, so main waits with the deadline and leaves
  // without cleanup if it passes; a second signal leaves at once.
  (*frontend)->BeginDrain();
  absl::Notification drained;
  std::thread drainer([&] {
    batcher.Shutdown();
    (*frontend)->Shutdown(deadline);
    (*metrics_server)->Stop();
    drained.Notify();
  });
  const timespec poll = {.tv_sec = 0, .tv_nsec = 50'000'000};
  while (!drained.HasBeenNotified()) {
    if (sigtimedwait(&signals, nullptr, &poll) > 0) {
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
  return 0;
}

}  // namespace
}  // namespace layerserve

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "layerserve --model-dir=DIR --layers=A:B [--grpc-port=8001 --metrics-port=8002 ...]\n"
      "Serves a span of Llama decoder layers over gRPC (Open Inference Protocol).\n"
      "Flags may be spelled with dashes or underscores (--grpc-port, --grpc_port).");
  std::vector<std::string> args = layerserve::UnderscoreFlagNames(argc, argv);
  std::vector<char*> arg_pointers;
  for (std::string& arg : args) arg_pointers.push_back(arg.data());
  absl::ParseCommandLine(static_cast<int>(arg_pointers.size()), arg_pointers.data());
  return layerserve::Run();
}
