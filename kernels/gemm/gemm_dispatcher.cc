// GemmDispatcher: the one place that decides, per (M bucket, N, K), whether a
// projection runs on one of our kernels or on cuBLASLt.
//
// Defaults (before any autotune) follow the H100 measurements in
// docs/perf-gemm.md: the small-M kernel (v4) for M <= 16, where it matches or
// beats cuBLASLt on the Llama-3-8B shapes, and cuBLASLt everywhere else
// (v3 reaches 0.8-1.0x of it, v5 0.8-1.0x; autotune picks per bucket).
// cuBLASLt also wherever our kernels cannot run (no Hopper, no sm_90a code
// in this binary, N or K not multiples of 8).
// Autotune replaces the defaults with measured winners per bucket;
// SetOverride pins a choice. Run() still checks each launch and falls back to
// cuBLASLt when the chosen kernel does not take the call (e.g. misaligned
// pointers).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/gemm/gemm_internal.h"
#include "layerserve/kernels/gemm.h"

namespace layerserve::kernels {
namespace {

constexpr std::array<int64_t, 12> kBucketUpper = {8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};
// Autotune shapes stop here: the last bucket is timed at this M.
constexpr int64_t kTuneMaxM = 8192;

// Owns a device buffer for the autotune pass.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  absl::Status Allocate(size_t bytes) {
    LS_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr_, bytes));
    return absl::OkStatus();
  }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

class EventPair {
 public:
  ~EventPair() {
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
  }
  absl::Status Create() {
    LS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start_));
    LS_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop_));
    return absl::OkStatus();
  }
  cudaEvent_t start() const { return start_; }
  cudaEvent_t stop() const { return stop_; }

 private:
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

// One candidate's launches run(0..kLaunches-1) captured into a CUDA graph:
// back to back, without host launch cost, as a layer's projections run.
class LaunchGraph {
 public:
  static constexpr int kLaunches = 10;

  LaunchGraph() = default;
  LaunchGraph(LaunchGraph&& other) noexcept : exec_(std::exchange(other.exec_, nullptr)) {}
  LaunchGraph& operator=(LaunchGraph&&) = delete;
  ~LaunchGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  }

  template <typename Run>
  absl::Status Capture(Run& run, cudaStream_t stream) {
    cudaGraph_t graph = nullptr;
    LS_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    absl::Status captured = absl::OkStatus();
    for (int i = 0; i < kLaunches && captured.ok(); ++i) captured = run(i);
    const cudaError_t end = cudaStreamEndCapture(stream, &graph);
    LS_GEMM_RETURN_IF_ERROR(captured);
    LS_CUDA_RETURN_IF_ERROR(end);
    const cudaError_t inst = cudaGraphInstantiate(&exec_, graph, 0);
    cudaGraphDestroy(graph);
    LS_CUDA_RETURN_IF_ERROR(inst);
    LS_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_, stream));  // warm-up replay
    return absl::OkStatus();
  }

  // Milliseconds per launch over one replay.
  absl::StatusOr<float> Time(cudaStream_t stream, const EventPair& events) const {
    float ms = 0;
    LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events.start(), stream));
    LS_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_, stream));
    LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(events.stop(), stream));
    LS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(events.stop()));
    LS_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events.start(), events.stop()));
    return ms / kLaunches;
  }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// Timed replays per candidate, one per round; rounds interleave the
// candidates so clock and power drift during the pass does not favour one,
// and the median keeps a one-off stall from deciding the choice.
constexpr int kTuneRounds = 5;

}  // namespace

GemmDispatcher::GemmDispatcher(std::unique_ptr<CublasLtGemm> cublaslt, bool custom_kernels_available)
    : cublaslt_(std::move(cublaslt)), custom_kernels_available_(custom_kernels_available) {}

GemmDispatcher::~GemmDispatcher() = default;

absl::StatusOr<std::unique_ptr<GemmDispatcher>> GemmDispatcher::Create() {
  absl::StatusOr<std::unique_ptr<CublasLtGemm>> cublaslt = CublasLtGemm::Create();
  if (!cublaslt.ok()) return cublaslt.status();
  absl::StatusOr<gemm::DeviceInfo> dev = gemm::CurrentDeviceInfo();
  if (!dev.ok()) return dev.status();
  const bool custom = dev->cc_major == 9 && dev->cc_minor == 0 && gemm::BuiltWithSm90a();
  return std::unique_ptr<GemmDispatcher>(new GemmDispatcher(*std::move(cublaslt), custom));
}

int GemmDispatcher::MBucket(int64_t m) {
  for (size_t b = 0; b < kBucketUpper.size(); ++b) {
    if (m <= kBucketUpper[b]) return static_cast<int>(b);
  }
  return static_cast<int>(kBucketUpper.size()) - 1;
}

int64_t GemmDispatcher::MBucketUpperBound(int bucket) {
  return kBucketUpper[std::clamp<size_t>(bucket, 0, kBucketUpper.size() - 1)];
}

GemmConfig GemmDispatcher::Choose(int64_t m, int64_t n, int64_t k) const {
  const auto it = choices_.find({MBucket(m), n, k});
  if (it != choices_.end()) return it->second;
  if (!custom_kernels_available_ || n % 8 != 0 || k % 8 != 0 || m > 16) return GemmConfig{GemmVersion::kCublasLt};
  return GemmConfig{GemmVersion::kSmallMSplitK};
}

void GemmDispatcher::SetOverride(int64_t m, int64_t n, int64_t k, const GemmConfig& config) {
  choices_[{MBucket(m), n, k}] = config;
}

absl::Status GemmDispatcher::Run(const GemmParams& p, cudaStream_t stream) {
  const GemmConfig config = Choose(p.m, p.n, p.k);
  if (config.version == GemmVersion::kCublasLt || !GemmSupported(p, config).ok()) {
    return cublaslt_->Run(p, stream);
  }
  return LaunchGemm(p, config, stream);
}

absl::StatusOr<std::vector<GemmTuneResult>> GemmDispatcher::Autotune(int64_t n, int64_t k, cudaStream_t stream,
                                                                     int64_t max_m) {
  std::vector<GemmTuneResult> results;
  if (!custom_kernels_available_ || n % 8 != 0 || k % 8 != 0 || max_m < 1) return results;
  int device = 0, l2_bytes = 0;
  LS_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  LS_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  const int last_bucket = MBucket(max_m);
  const int64_t rows = std::min(MBucketUpperBound(last_bucket), kTuneMaxM);
  // Enough copies of W that timed launches stream it from HBM, as serving does.
  const size_t w_bytes = static_cast<size_t>(n * k) * 2;
  const int w_sets = static_cast<int>(std::max<size_t>(2, (2 * static_cast<size_t>(l2_bytes) + w_bytes - 1) / w_bytes));
  DeviceBuffer a, c;
  std::vector<DeviceBuffer> w(w_sets);
  LS_GEMM_RETURN_IF_ERROR(a.Allocate(static_cast<size_t>(rows * k) * 2));
  LS_GEMM_RETURN_IF_ERROR(c.Allocate(static_cast<size_t>(rows * n) * 2));
  LS_GEMM_RETURN_IF_ERROR(gemm::FillRandomBf16(a.get(), rows * k, 1, stream));
  for (int i = 0; i < w_sets; ++i) {
    LS_GEMM_RETURN_IF_ERROR(w[i].Allocate(w_bytes));
    LS_GEMM_RETURN_IF_ERROR(gemm::FillRandomBf16(w[i].get(), n * k, 2 + i, stream));
  }
  EventPair events;
  LS_GEMM_RETURN_IF_ERROR(events.Create());

  for (int bucket = 0; bucket <= last_bucket; ++bucket) {
    GemmParams p;
    p.a = a.get();
    p.c = c.get();
    p.m = std::min(MBucketUpperBound(bucket), rows);
    p.n = n;
    p.k = k;
    std::vector<GemmConfig> candidates = {{GemmVersion::kCublasLt, 0, 0},
                                          {GemmVersion::kWarpSpecialized, 0, 256},
                                          {GemmVersion::kWarpSpecialized, 0, 128}};
    if (p.m <= 64) {
      for (int s : {1, 2, 4, 8}) candidates.push_back({GemmVersion::kSmallMSplitK, s, 0});
    } else {
      candidates.push_back({GemmVersion::kClusterMulticast, 0, 0});
    }
    std::vector<GemmConfig> configs;
    std::vector<LaunchGraph> graphs;
    for (const GemmConfig& config : candidates) {
      p.w = w[0].get();
      if (config.version != GemmVersion::kCublasLt && !GemmSupported(p, config).ok()) continue;
      auto run = [&](int i) {
        p.w = w[i % w_sets].get();
        return config.version == GemmVersion::kCublasLt ? cublaslt_->Run(p, stream) : LaunchGemm(p, config, stream);
      };
      LS_GEMM_RETURN_IF_ERROR(run(0));  // plans, module load, L2 state
      LaunchGraph graph;
      LS_GEMM_RETURN_IF_ERROR(graph.Capture(run, stream));
      configs.push_back(config);
      graphs.push_back(std::move(graph));
    }
    std::vector<std::array<float, kTuneRounds>> times(graphs.size());
    for (int round = 0; round < kTuneRounds; ++round) {
      for (size_t i = 0; i < graphs.size(); ++i) {
        absl::StatusOr<float> ms = graphs[i].Time(stream, events);
        if (!ms.ok()) return ms.status();
        times[i][round] = *ms;
      }
    }
    GemmTuneResult result{bucket, p.m, n, k, configs.front(), -1.f, -1.f};
    for (size_t i = 0; i < graphs.size(); ++i) {
      std::sort(times[i].begin(), times[i].end());
      const float us = 1e3f * times[i][kTuneRounds / 2];
      if (configs[i].version == GemmVersion::kCublasLt) result.cublaslt_us = us;
      if (result.chosen_us < 0.f || us < result.chosen_us) {
        result.chosen_us = us;
        result.chosen = configs[i];
      }
    }
    choices_[{bucket, n, k}] = result.chosen;
    results.push_back(result);
  }
  LS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return results;
}

}  // namespace layerserve::kernels
