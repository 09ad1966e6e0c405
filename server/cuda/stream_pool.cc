#include "server/cuda/stream_pool.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/cuda/cuda_status.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "base/thread_name.h"
#include "server/core/warm_up.h"
#include "server/cuda/batch_launch.h"
#include "server/cuda/batch_staging.h"
#include "server/cuda/forward_graphs.h"

namespace layerserve::cuda {
namespace {

// Device memory KvMemoryAvailable keeps back from the KV pool, for what is
// allocated after it: lazily loaded kernel modules (tens of MiB), cuBLASLt's
// internal buffers, the runtime's own growth. A fixed 1 GiB rather than a
// share of the device: what it covers does not grow with the GPU, and
// --kv-cache-memory's fraction (auto: 0.9) leaves a proportional margin on
// top.
constexpr int64_t kKvReserveBytes = int64_t{1} << 30;

// Warm-up batches of every size from 1 token to this many (WarmUp): the
// batches a decode load of up to a few hundred sessions forms.
constexpr int64_t kWarmUpEverySizeUpTo = 256;

}  // namespace

StreamPool::StreamPool(const CudaBackendOptions& options, const LlamaConfig& config,
                       std::vector<int> windows, std::string device_name, DeviceWeights weights,
                       std::unique_ptr<kernels::GemmRouter> gemm,
                       std::vector<GemmRoute> gemm_routes, kernels::DType dtype,
                       kernels::DeviceInfo device, std::vector<std::unique_ptr<StreamSlot>> slots)
    : options_(options),
      config_(config),
      device_name_(std::move(device_name)),
      weights_(std::move(weights)),
      gemm_(std::move(gemm)),
      gemm_routes_(std::move(gemm_routes)),
      executor_(LayerShape::FromConfig(config, dtype), weights_.layers(), weights_.inv_freq(),
                gemm_.get(), device, std::move(windows)),
      slots_(std::move(slots)) {
  for (const auto& slot : slots_) {
    activation_bytes_ += slot->arena.bytes() + slot->io_device.bytes() + slot->workspace.bytes();
  }
  for (const auto& slot : slots_) {
    workers_.emplace_back([this, s = slot.get()] {
      NameThisThread(absl::StrCat("stream-", s->index));
      WorkerLoop(*s);
    });
  }
}

StreamPool::~StreamPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  work_cv_.SignalAll();
  for (std::thread& worker : workers_) worker.join();
  // The members' destructors release device memory on this thread.
  static_cast<void>(cudaSetDevice(options_.device));
}

void StreamPool::Execute(std::shared_ptr<Batch> batch, std::function<void(absl::Status)> done) {
  {
    MutexLock lock(&mu_);
    queue_.push_back(Job{std::move(batch), std::move(done)});
  }
  work_cv_.Signal();
}

absl::Status StreamPool::Health() const {
  MutexLock lock(&health_mu_);
  return health_;
}

absl::StatusOr<int64_t> StreamPool::DeviceMemoryUsedBytes() const {
  LS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  LS_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<int64_t>(total_bytes - free_bytes);
}

int64_t StreamPool::KvBlockBytes(int64_t block_tokens) const {
  return KvPool::BlockBytes(executor_.shape(), options_.kv_cache_dtype, executor_.num_layers(),
                            block_tokens);
}

// kKvReserveBytes covers kernel modules loaded lazily on their first launch,
// cuBLASLt's internal allocations, the CUDA runtime's own growth. 0 when the
// device cannot be queried.
int64_t StreamPool::KvMemoryAvailable() const {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  if (cudaSetDevice(options_.device) != cudaSuccess ||
      cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return 0;
  }
  return std::max<int64_t>(0, static_cast<int64_t>(free_bytes) - kKvReserveBytes);
}

// One cudaMalloc for the pool plus each stream's staging, outside the lock;
// the pool is installed once and never replaced, so a stream's thread may
// use it without the lock once it has read the pointer.
absl::Status StreamPool::AllocateKvCache(const KvCacheShape& shape) {
  const auto already = [] {
    return absl::FailedPreconditionError("cuda backend: the KV cache is already allocated");
  };
  {
    MutexLock lock(&kv_mu_);
    if (kv_pool_ != nullptr) return already();
  }
  LS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  LS_ASSIGN_OR_RETURN(
      std::unique_ptr<KvPool> pool,
      KvPool::Create(executor_.shape(), options_.kv_cache_dtype, executor_.num_layers(), shape,
                     static_cast<int>(slots_.size()), options_.max_batch_tokens));
  {
    MutexLock lock(&kv_mu_);
    if (kv_pool_ != nullptr) return already();
    kv_pool_ = std::move(pool);
  }
  return options_.warm_up ? WarmUpSessions(shape) : absl::OkStatus();
}

// The first launch of each kernel loads its module, and cuBLASLt plans each
// GEMM shape on its first use, which the first batch of a size would
// otherwise wait for. So, before serving, batches of zeros run through
// Execute like any batch (server/core/warm_up.h), outside the kernel-time
// metrics: one of every size up to kWarmUpEverySizeUpTo, since cuBLASLt
// plans each exact M (a decode batch of 64 sessions takes any size from 1 to
// 64), then one per GEMM token-count bucket up to max_batch_tokens. Design
// record 0003. Logs what it ran and how long it took.
absl::Status StreamPool::WarmUp() {
  const std::vector<int64_t> sizes =
      WarmUpSizes(options_.max_batch_tokens, kWarmUpEverySizeUpTo, kernels::kGemmBucketUpper);
  const auto start = std::chrono::steady_clock::now();
  warming_up_ = true;
  const absl::Status status = WarmUpStateless(*this, config_.hidden_size, sizes);
  warming_up_ = false;
  LS_RETURN_IF_ERROR(status);
  LogInfo(absl::StrCat(
      "cuda backend: warmed up with ", sizes.size(), " batches of 1 to ", sizes.back(),
      " tokens in ",
      absl::FormatDuration(absl::FromChrono(std::chrono::steady_clock::now() - start))));
  return absl::OkStatus();
}

// WarmUp's session step, once the pool exists: the RoPE + cache write, the
// paged attention and its combine load.
absl::Status StreamPool::WarmUpSessions(const KvCacheShape& shape) {
  warming_up_ = true;
  const absl::Status status = WarmUpSessionStep(*this, config_.hidden_size, shape);
  warming_up_ = false;
  return status;
}

void StreamPool::WorkerLoop(StreamSlot& slot) {
  const cudaError_t set_device = cudaSetDevice(options_.device);
  while (true) {
    Job job;
    {
      MutexLock lock(&mu_);
      while (!stop_ && queue_.empty()) work_cv_.Wait(&mu_);
      if (queue_.empty()) return;  // stop_ and drained
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    absl::Status status = set_device == cudaSuccess
                              ? RunBatch(slot, *job.batch)
                              : CudaError(set_device, "cudaSetDevice", __FILE__, __LINE__);
    job.done(std::move(status));
  }
}

absl::Status StreamPool::RunBatch(StreamSlot& slot, Batch& batch) {
  KvPool* kv_pool;  // null until AllocateKvCache
  {
    MutexLock lock(&kv_mu_);
    kv_pool = kv_pool_.get();
  }
  LS_RETURN_IF_ERROR(batch.Validate(config_.hidden_size, options_.max_batch_tokens,
                                    kv_pool != nullptr ? kv_pool->shape() : KvCacheShape{}));
  if (absl::Status health = Health(); !health.ok()) {
    return absl::UnavailableError(absl::StrCat("cuda backend is unhealthy: ", health.message()));
  }
  if (batch.total_tokens == 0) {
    for (const auto& request : batch.requests) request->output.clear();
    return absl::OkStatus();
  }

  const auto input_start = std::chrono::steady_clock::now();
  LS_ASSIGN_OR_RETURN(const BatchStaging staging,
                      BatchStaging::Pack(slot, batch, options_.max_batch_tokens));
  batch.timings.input_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - input_start).count();
  const int64_t tokens = batch.total_tokens;
  // Warm-up batches stay out of the kernel-time metrics.
  const bool sampled =
      options_.timing_sink != nullptr && options_.timing_sample_every > 0 && !warming_up_ &&
      batches_.fetch_add(1, std::memory_order_relaxed) % options_.timing_sample_every == 0;
  // From its launch to its end a batch counts as computing: one launched
  // while another computes launches directly (UseForwardGraph).
  const int others_computing = computing_.fetch_add(1, std::memory_order_acq_rel);
  const bool graph =
      UseForwardGraph(tokens, options_.cuda_graph_max_tokens, sampled, others_computing);
  BatchLaunch launch(slot, batch, staging, executor_, kv_pool, sampled);
  const absl::StatusOr<std::string_view> launched = launch.Launch(graph);
  absl::Status status = launched.status();
  if (status.ok()) {
    batch.timings.launch = *launched;
    status = [&]() -> absl::Status {
      LS_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot.done.get()));
      return absl::OkStatus();
    }();
  }
  computing_.fetch_sub(1, std::memory_order_acq_rel);
  if (!status.ok()) return BatchFailed(slot, tokens, status);

  if (sampled) {
    // Outputs are already correct: a timing failure must not fail the batch.
    static_cast<void>(slot.timer.Report(options_.timing_sink));
  }
  const auto output_start = std::chrono::steady_clock::now();
  staging.Unpack(slot, batch);
  batch.timings.output_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - output_start).count();
  return absl::OkStatus();
}

absl::Status StreamPool::BatchFailed(StreamSlot& slot, int64_t tokens, const absl::Status& cause) {
  const cudaError_t sync = cudaStreamSynchronize(slot.stream.get());
  const cudaError_t last = cudaGetLastError();  // clears a non-sticky error
  const cudaError_t sticky = IsStickyCudaError(sync)   ? sync
                             : IsStickyCudaError(last) ? last
                                                       : cudaPeekAtLastError();
  if (sticky != cudaSuccess) {
    MutexLock lock(&health_mu_);
    if (health_.ok()) {
      health_ = absl::InternalError(absl::StrCat(
          "unrecoverable CUDA error ", cudaGetErrorName(sticky), " (", cudaGetErrorString(sticky),
          "); the server must restart. First failure: ", cause.message()));
      LogError(absl::StrCat("cuda backend: ", health_.message()));
    }
  }
  return absl::InternalError(
      absl::StrCat("cuda backend: batch of ", tokens, " tokens failed: ", cause.message()));
}

}  // namespace layerserve::cuda
