// The CUDA backend (see cuda_backend.h): the stream pool and the life of a
// batch on one stream.
//
// Per batch, on the stream's own thread:
//   host:   each request's piece (all of it unless the request is chunked)
//           -> pinned staging (memcpy); positions and cu_seqlens -> pinned
//           metadata; with sessions, start positions and block tables -> the
//           KV pool's pinned staging for this stream
//   stream: H2D staging and metadata; per request Cast(wire dtype -> x rows);
//           the layers; per request Cast(x rows -> wire dtype) into the same
//           staging offsets; D2H staging; record the completion event
//   host:   wait for the event; pinned staging -> each request's output; done
// Inputs and outputs share the staging buffers: a request's output has the
// size and dtype of its input, and the stream orders the copy-out after the
// copy-in, so one buffer of each kind per stream is enough.
//
// Sessions: the KV pool (kv_pool.h) is allocated once by AllocateKvCache and
// shared by every stream. Two batches in flight never touch the same block:
// a session has one step in flight at a time, and the session table gives
// every sequence its own blocks. A session's next step runs only after the
// previous one's completion event, so it reads what that step stored.
#include "server/cuda/cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "base/cuda/cuda_resources.h"
#include "base/cuda/cuda_status.h"
#include "base/log.h"
#include "base/mutex.h"
#include "base/status_macros.h"
#include "base/thread_name.h"
#include "base/thread_pool.h"
#include "layerserve/kernels/layer_ops.h"
#include "server/core/warm_up.h"
#include "server/cuda/device_weights.h"
#include "server/cuda/forward_graphs.h"
#include "server/cuda/gemm_tuning.h"
#include "server/cuda/kv_pool.h"
#include "server/cuda/layer_executor.h"

namespace layerserve {
namespace {

// Below this many bytes moved per batch, a stream copies on its own thread:
// for a few 16 KiB rows, waking the pool costs more than it saves; from a
// few hundred KiB the pool unpacks faster. Design record 0002.
constexpr size_t kParallelCopyBytes = size_t{256} << 10;

using cuda::ActivationArena;
using cuda::CudaEvent;
using cuda::CudaStream;
using cuda::DeviceBuffer;
using cuda::OpTimer;
using cuda::PinnedBuffer;

kernels::DType KernelDType(DType t) {
  switch (t) {
    case DType::kF32:
      return kernels::DType::kF32;
    case DType::kF16:
      return kernels::DType::kF16;
    case DType::kBF16:
      return kernels::DType::kBF16;
    case DType::kF8E4M3:  // weights only: never a request's dtype
      break;
  }
  return kernels::DType::kF32;
}

std::string_view KernelDTypeName(kernels::DType t) {
  return t == kernels::DType::kF16 ? "fp16" : t == kernels::DType::kBF16 ? "bf16" : "fp32";
}

// Everything one stream owns. Touched only by that stream's thread.
struct StreamSlot {
  int index = 0;  // in the pool of streams (its KvPool staging)
  CudaStream stream;
  CudaEvent done;  // recorded after the copy-out; the thread waits on it
  ActivationArena arena;
  DeviceBuffer io_device;  // wire-dtype inputs, then outputs, of the batch
  PinnedBuffer io_host;
  PinnedBuffer meta_host;  // positions [tokens] then cu_seqlens [num_seqs + 1]
  // A mixture of experts: each layer's tokens per expert, copied back with
  // the outputs (ActivationArena::expert_tokens).
  PinnedBuffer expert_tokens_host;
  // Copies large batches' tensors to and from io_host (ForEachRequest); the
  // stream's thread is one of its threads.
  std::unique_ptr<ThreadPool> copy_pool;
  DeviceBuffer workspace;  // cuBLASLt
  OpTimer timer;
  // Captured Forwards of small batches (forward_graphs.h).
  std::unique_ptr<cuda::ForwardGraphs> graphs;
};

// Warm-up batches of every size from 1 token to this many (WarmUp): the
// batches a decode load of up to a few hundred sessions forms.
constexpr int64_t kWarmUpEverySizeUpTo = 256;

// Graphs each stream keeps (its most recently used batch keys). A decode
// load meets one key per batch size it forms, at most a few dozen below
// 256 tokens, each graph a few kilobytes of driver state.
constexpr size_t kGraphsPerStream = 128;

absl::StatusOr<std::unique_ptr<StreamSlot>> MakeSlot(int index, const cuda::LayerShape& shape,
                                                     int64_t max_tokens, int num_layers,
                                                     size_t workspace_bytes, int copy_threads,
                                                     bool blocking_wait) {
  auto slot = std::make_unique<StreamSlot>();
  slot->index = index;
  slot->copy_pool =
      std::make_unique<ThreadPool>(std::max(1, copy_threads), absl::StrCat("copy", index));
  slot->graphs = std::make_unique<cuda::ForwardGraphs>(kGraphsPerStream);
  const size_t t = static_cast<size_t>(max_tokens);
  const size_t io_bytes = t * static_cast<size_t>(shape.hidden) * sizeof(float);
  LS_ASSIGN_OR_RETURN(slot->stream, cuda::CreateStream());
  LS_ASSIGN_OR_RETURN(slot->done, cuda::CreateEvent(cudaEventDisableTiming |
                                                    (blocking_wait ? cudaEventBlockingSync : 0u)));
  LS_ASSIGN_OR_RETURN(slot->arena, ActivationArena::Create(shape, max_tokens, num_layers));
  if (shape.experts > 0) {
    LS_ASSIGN_OR_RETURN(
        slot->expert_tokens_host,
        PinnedBuffer::Allocate(static_cast<size_t>(num_layers) * shape.experts * sizeof(int32_t)));
  }
  LS_ASSIGN_OR_RETURN(slot->io_device, DeviceBuffer::Allocate(io_bytes));
  LS_ASSIGN_OR_RETURN(slot->io_host, PinnedBuffer::Allocate(io_bytes));
  LS_ASSIGN_OR_RETURN(slot->meta_host, PinnedBuffer::Allocate((2 * t + 1) * sizeof(int32_t)));
  LS_ASSIGN_OR_RETURN(slot->workspace, DeviceBuffer::Allocate(workspace_bytes));
  LS_ASSIGN_OR_RETURN(slot->timer, OpTimer::Create(num_layers * cuda::kOpsPerLayer));
  return slot;
}

// Device memory KvMemoryAvailable keeps back from the KV pool, for what is
// allocated after it: lazily loaded kernel modules (tens of MiB), cuBLASLt's
// internal buffers, the runtime's own growth. A fixed 1 GiB rather than a
// share of the device: what it covers does not grow with the GPU, and
// --kv-cache-memory's fraction (auto: 0.9) leaves a proportional margin on
// top.
constexpr int64_t kKvReserveBytes = int64_t{1} << 30;

class CudaBackendImpl final : public CudaBackend {
 public:
  CudaBackendImpl(const CudaBackendOptions& options, const LlamaConfig& config,
                  std::vector<int> windows, std::string device_name, cuda::DeviceWeights weights,
                  std::unique_ptr<kernels::GemmRouter> gemm,
                  std::vector<cuda::GemmRoute> gemm_routes, kernels::DType dtype,
                  std::vector<std::unique_ptr<StreamSlot>> slots)
      : options_(options),
        config_(config),
        device_name_(std::move(device_name)),
        weights_(std::move(weights)),
        gemm_(std::move(gemm)),
        gemm_routes_(std::move(gemm_routes)),
        executor_(cuda::LayerShape::FromConfig(config, dtype), weights_.layers(),
                  weights_.inv_freq(), gemm_.get(), std::move(windows)),
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

  ~CudaBackendImpl() override {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    work_cv_.SignalAll();
    for (std::thread& worker : workers_) worker.join();
    // The members' destructors release device memory on this thread.
    static_cast<void>(cudaSetDevice(options_.device));
  }

  std::string_view Name() const override { return "cuda"; }
  std::string Device() const override { return device_name_; }
  int MaxInflightBatches() const override { return static_cast<int>(slots_.size()); }

  void Execute(std::shared_ptr<Batch> batch, std::function<void(absl::Status)> done) override {
    {
      MutexLock lock(&mu_);
      queue_.push_back(Job{std::move(batch), std::move(done)});
    }
    work_cv_.Signal();
  }

  absl::Status Health() const override {
    MutexLock lock(&health_mu_);
    return health_;
  }

  size_t WeightBytes() const override { return weights_.bytes(); }
  size_t ActivationBytes() const override { return activation_bytes_; }
  const std::vector<cuda::GemmRoute>& GemmRoutes() const override { return gemm_routes_; }

  absl::StatusOr<int64_t> DeviceMemoryUsedBytes() const override {
    LS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    LS_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    return static_cast<int64_t>(total_bytes - free_bytes);
  }

  // K and V of every layer, in the activation dtype (2 bytes).
  int64_t KvBlockBytes(int64_t block_tokens) const override {
    return cuda::KvPool::BlockBytes(executor_.shape(), executor_.num_layers(), block_tokens);
  }

  // What the device has free now (after the weights and the stream pool, and
  // before the KV pool), less kKvReserveBytes for what is allocated later:
  // kernel modules loaded lazily on their first launch, cuBLASLt's internal
  // allocations, the CUDA runtime's own growth. 0 when the device cannot be
  // queried.
  int64_t KvMemoryAvailable() const override {
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
  absl::Status AllocateKvCache(const KvCacheShape& shape) override {
    const auto already = [] {
      return absl::FailedPreconditionError("cuda backend: the KV cache is already allocated");
    };
    {
      MutexLock lock(&kv_mu_);
      if (kv_pool_ != nullptr) return already();
    }
    LS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
    LS_ASSIGN_OR_RETURN(
        std::unique_ptr<cuda::KvPool> pool,
        cuda::KvPool::Create(executor_.shape(), executor_.num_layers(), shape,
                             static_cast<int>(slots_.size()), options_.max_batch_tokens));
    {
      MutexLock lock(&kv_mu_);
      if (kv_pool_ != nullptr) return already();
      kv_pool_ = std::move(pool);
    }
    return options_.warm_up ? WarmUpSessions(shape) : absl::OkStatus();
  }

  // The first launch of each kernel loads its module, and cuBLASLt plans
  // each GEMM shape on its first use, which the first batch of a size would
  // otherwise wait for. So, before serving, batches of zeros run through
  // Execute like any batch (server/core/warm_up.h), outside the kernel-time
  // metrics: one of every size up to kWarmUpEverySizeUpTo, since cuBLASLt
  // plans each exact M (a decode batch of 64 sessions takes any size from 1
  // to 64), then one per GEMM token-count bucket up to max_batch_tokens.
  // Design record 0003. Logs what it ran and how long it took.
  absl::Status WarmUp() {
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

 private:
  // WarmUp's session step, once the pool exists: the RoPE + cache write,
  // the paged attention and its combine load.
  absl::Status WarmUpSessions(const KvCacheShape& shape) {
    warming_up_ = true;
    const absl::Status status = WarmUpSessionStep(*this, config_.hidden_size, shape);
    warming_up_ = false;
    return status;
  }

  struct Job {
    std::shared_ptr<Batch> batch;
    std::function<void(absl::Status)> done;
  };

  // One per stream: runs queued batches until shutdown, then drains the queue
  // so every `done` is called exactly once.
  void WorkerLoop(StreamSlot& slot) {
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

  absl::Status RunBatch(StreamSlot& slot, Batch& batch) {
    cuda::KvPool* kv_pool;  // null until AllocateKvCache
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

    const int64_t tokens = batch.total_tokens;
    const int num_seqs = static_cast<int>(batch.cu_seqlens.size()) - 1;
    // The metadata holds tokens + num_seqs + 1 values in room for
    // 2 max_tokens + 1 (frontends send no empty sequences; a direct caller might).
    if (num_seqs > options_.max_batch_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("cuda backend: a batch of ", num_seqs,
                                                     " sequences, more than max_batch_tokens (",
                                                     options_.max_batch_tokens, ")"));
    }
    // Positions are int32 on the device.
    for (int s = 0; s < num_seqs; ++s) {
      const int64_t reach = batch.kv[s].position + batch.cu_seqlens[s + 1] - batch.cu_seqlens[s];
      if (reach > INT32_MAX) {
        return absl::InvalidArgumentError(absl::StrCat("cuda backend: a sequence reaches position ",
                                                       reach, ", past the int32 positions"));
      }
    }

    // Pack inputs and metadata into pinned memory: each request's pieces, in
    // sequence order (one contiguous run per request).
    const auto input_start = std::chrono::steady_clock::now();
    std::vector<size_t> offsets;
    offsets.reserve(batch.requests.size());
    size_t io_bytes = 0;
    for (const auto& request : batch.requests) {
      offsets.push_back(io_bytes);
      io_bytes += static_cast<size_t>(request->batch) * PieceBytes(*request);
    }
    ForEachRequest(slot, batch, io_bytes, [&](size_t i) {
      const InferRequest& request = *batch.requests[i];
      const size_t element = DTypeSize(request.dtype);
      const size_t piece = PieceBytes(request);
      for (int64_t b = 0; b < request.batch; ++b) {
        std::memcpy(slot.io_host.data() + offsets[i] + static_cast<size_t>(b) * piece,
                    request.input.data() + request.piece_offset(b) * element, piece);
      }
    });
    auto* meta = reinterpret_cast<int32_t*>(slot.meta_host.data());
    int max_seqlen = 0;
    for (int s = 0; s < num_seqs; ++s) {
      const int32_t begin = batch.cu_seqlens[s];
      const int32_t len = batch.cu_seqlens[s + 1] - begin;
      const auto start = static_cast<int32_t>(batch.kv[s].position);  // 0: stateless
      max_seqlen = std::max(max_seqlen, len);
      for (int32_t i = 0; i < len; ++i) meta[begin + i] = start + i;
    }
    std::memcpy(meta + tokens, batch.cu_seqlens.data(), batch.cu_seqlens.size() * sizeof(int32_t));
    cuda::BatchGeometry geometry;
    geometry.tokens = tokens;
    geometry.num_seqs = num_seqs;
    geometry.max_seqlen = max_seqlen;
    geometry.positions = slot.arena.meta;
    geometry.cu_seqlens = slot.arena.meta + tokens;

    const auto input_end = std::chrono::steady_clock::now();
    batch.timings.input_seconds = std::chrono::duration<double>(input_end - input_start).count();
    // Warm-up batches stay out of the kernel-time metrics.
    const bool sampled =
        options_.timing_sink != nullptr && options_.timing_sample_every > 0 && !warming_up_ &&
        batches_.fetch_add(1, std::memory_order_relaxed) % options_.timing_sample_every == 0;
    // From its enqueue to its end a batch counts as computing: one enqueued
    // while another computes launches directly (UseForwardGraph).
    const int others_computing = computing_.fetch_add(1, std::memory_order_acq_rel);
    const bool graph =
        cuda::UseForwardGraph(tokens, options_.cuda_graph_max_tokens, sampled, others_computing);
    absl::Status status =
        Enqueue(slot, batch, offsets, io_bytes, kv_pool, geometry, sampled, graph);
    if (status.ok()) {
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
    if (slot.arena.expert_tokens != nullptr) {
      const auto* counts = reinterpret_cast<const int32_t*>(slot.expert_tokens_host.data());
      batch.expert_tokens.assign(counts,
                                 counts + slot.expert_tokens_host.bytes() / sizeof(int32_t));
    }
    const auto output_start = std::chrono::steady_clock::now();
    ForEachRequest(slot, batch, io_bytes, [&](size_t i) {
      InferRequest& request = *batch.requests[i];
      const size_t element = DTypeSize(request.dtype);
      const size_t piece = PieceBytes(request);
      request.output.resize(request.input.size());  // once: later pieces keep earlier rows
      for (int64_t b = 0; b < request.batch; ++b) {
        std::memcpy(request.output.data() + request.piece_offset(b) * element,
                    slot.io_host.data() + offsets[i] + static_cast<size_t>(b) * piece, piece);
      }
    });
    batch.timings.output_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - output_start).count();
    return absl::OkStatus();
  }

  // Runs copy(i) for every request of the batch: on the stream's copy pool
  // when the batch moves at least kParallelCopyBytes (a 128-token FP32
  // request of Llama-3-8B is 2 MiB each way), else inline, where waking the
  // pool would cost more. Design record 0002.
  static void ForEachRequest(StreamSlot& slot, const Batch& batch, size_t io_bytes,
                             absl::FunctionRef<void(size_t)> copy) {
    const auto n = static_cast<int64_t>(batch.requests.size());
    if (io_bytes < kParallelCopyBytes) {
      for (int64_t i = 0; i < n; ++i) copy(static_cast<size_t>(i));
      return;
    }
    slot.copy_pool->ParallelFor(n, [&](int64_t i) { copy(static_cast<size_t>(i)); });
  }

  // Bytes of one of a request's B pieces on the wire (of its whole sequence
  // unless it is chunked).
  static size_t PieceBytes(const InferRequest& request) {
    return static_cast<size_t>(request.piece_tokens() * request.hidden) * DTypeSize(request.dtype);
  }

  // Enqueues the whole batch on the slot's stream (with sessions, after the
  // KV metadata's upload, which completes `geometry`), its layers through
  // the stream's CUDA graphs when `graph`.
  absl::Status Enqueue(StreamSlot& slot, Batch& batch, const std::vector<size_t>& offsets,
                       size_t io_bytes, cuda::KvPool* kv_pool, cuda::BatchGeometry geometry,
                       bool sampled, bool graph) {
    const cudaStream_t stream = slot.stream.get();
    const kernels::DType act = executor_.shape().dtype;
    const size_t row_bytes = static_cast<size_t>(config_.hidden_size) * kernels::DTypeBytes(act);
    auto* io_device = static_cast<unsigned char*>(slot.io_device.data());
    auto* x = static_cast<unsigned char*>(slot.arena.x);

    LS_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(io_device, slot.io_host.data(), io_bytes, cudaMemcpyHostToDevice, stream));
    LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        slot.arena.meta, slot.meta_host.data(),
        (static_cast<size_t>(geometry.tokens) + geometry.num_seqs + 1) * sizeof(int32_t),
        cudaMemcpyHostToDevice, stream));
    if (batch.has_sessions) {
      LS_ASSIGN_OR_RETURN(const cuda::BatchKvMeta kv,
                          kv_pool->Upload(batch, slot.index, stream, /*pad_plan=*/graph));
      cuda::AttachKv(kv_pool, kv, &geometry);
    }
    // Wire dtype <-> activation dtype. Requests are packed in order on both
    // sides, so each run of consecutive requests with one wire dtype is one
    // contiguous range: one cast (or copy) per run, not per request, keeps
    // a batch of many 1-token requests from paying a launch for each.
    const auto convert = [&](bool to_activation) -> absl::Status {
      size_t row = 0;
      for (size_t i = 0; i < batch.requests.size();) {
        const kernels::DType wire_dtype = KernelDType(batch.requests[i]->dtype);
        size_t end = i;
        size_t bytes = 0, rows_in_run = 0;
        int64_t elements = 0;
        for (; end < batch.requests.size() && KernelDType(batch.requests[end]->dtype) == wire_dtype;
             ++end) {
          const InferRequest& request = *batch.requests[end];
          bytes += static_cast<size_t>(request.batch) * PieceBytes(request);
          rows_in_run += static_cast<size_t>(request.batch_tokens());
          elements += request.batch_tokens() * request.hidden;
        }
        void* wire = io_device + offsets[i];
        void* rows = x + row * row_bytes;
        if (wire_dtype == act) {
          LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to_activation ? rows : wire,
                                                  to_activation ? wire : rows, bytes,
                                                  cudaMemcpyDeviceToDevice, stream));
        } else {
          kernels::CastParams cast;
          cast.src = to_activation ? wire : rows;
          cast.src_dtype = to_activation ? wire_dtype : act;
          cast.dst = to_activation ? rows : wire;
          cast.dst_dtype = to_activation ? act : wire_dtype;
          cast.n = elements;
          LS_RETURN_IF_ERROR(kernels::LaunchCast(cast, stream));
        }
        row += rows_in_run;
        i = end;
      }
      return absl::OkStatus();
    };
    LS_RETURN_IF_ERROR(convert(true));
    const kernels::GemmWorkspace workspace{slot.workspace.data(), slot.workspace.bytes()};
    const auto forward = [&] {
      return executor_.Forward(slot.arena, geometry, workspace, stream,
                               sampled ? &slot.timer : nullptr);
    };
    // After the layers: back to the wire dtype, the copies to the host, and
    // the event the stream's thread waits on.
    const auto rest = [&]() -> absl::Status {
      LS_RETURN_IF_ERROR(convert(false));
      LS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.io_host.data(), io_device, io_bytes,
                                              cudaMemcpyDeviceToHost, stream));
      if (slot.arena.expert_tokens != nullptr) {
        LS_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(slot.expert_tokens_host.data(), slot.arena.expert_tokens,
                            slot.expert_tokens_host.bytes(), cudaMemcpyDeviceToHost, stream));
      }
      LS_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.done.get(), stream));
      return absl::OkStatus();
    };
    if (graph) {
      LS_ASSIGN_OR_RETURN(const cuda::GraphLaunch launch,
                          slot.graphs->Run(cuda::GraphKeyOf(geometry), stream, forward, rest));
      batch.timings.launch = cuda::GraphLaunchName(launch);
      return absl::OkStatus();
    }
    LS_RETURN_IF_ERROR(forward());
    batch.timings.launch = cuda::GraphLaunchName(cuda::GraphLaunch::kDirect);
    return rest();
  }

  // Drains the stream (so no launched work still touches the slot's buffers
  // when the next batch packs into them) and classifies the failure: a sticky
  // error marks the backend unhealthy for good.
  absl::Status BatchFailed(StreamSlot& slot, int64_t tokens, const absl::Status& cause) {
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

  const CudaBackendOptions options_;
  const LlamaConfig config_;
  const std::string device_name_;
  const cuda::DeviceWeights weights_;
  const std::unique_ptr<kernels::GemmRouter> gemm_;
  const std::vector<cuda::GemmRoute> gemm_routes_;
  const cuda::LayerExecutor executor_;
  const std::vector<std::unique_ptr<StreamSlot>> slots_;
  size_t activation_bytes_ = 0;
  std::atomic<uint64_t> batches_{0};
  std::atomic<int> computing_{0};        // batches between their enqueue and their end
  std::atomic<bool> warming_up_{false};  // a warm-up batch is running (before serving)

  // Set once by AllocateKvCache, never replaced (see there).
  Mutex kv_mu_;
  std::unique_ptr<cuda::KvPool> kv_pool_ ABSL_GUARDED_BY(kv_mu_);

  mutable Mutex health_mu_;
  absl::Status health_ ABSL_GUARDED_BY(health_mu_);

  Mutex mu_;
  CondVar work_cv_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;  // last: started once everything above exists
};

absl::Status ValidateOptions(const ModelSpan& model, const CudaBackendOptions& options) {
  if (model.layers.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: model '", model.name, "' has no layers"));
  }
  const LlamaConfig& c = model.config;
  if (c.hidden_size <= 0 || c.intermediate_size <= 0 || c.num_attention_heads <= 0 ||
      c.num_key_value_heads <= 0 || c.num_attention_heads % c.num_key_value_heads != 0 ||
      c.hidden_size % 8 != 0 || c.intermediate_size % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: model '", model.name, "' has an inconsistent configuration"));
  }
  if (c.head_dim != 64 && c.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda backend: head_dim ", c.head_dim, " is not supported (flash attention: 64 or 128)"));
  }
  if (options.num_streams < 1 || options.num_streams > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: num_streams must be in [1, 64], got ", options.num_streams));
  }
  if (options.max_batch_tokens < 1 || options.max_batch_tokens > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda backend: max_batch_tokens must be in [1, 16777216], got ", options.max_batch_tokens));
  }
  if (options.cuda_graph_max_tokens < 0) {
    return absl::InvalidArgumentError("cuda backend: cuda_graph_max_tokens must be >= 0");
  }
  if (options.timing_sample_every < 0) {
    return absl::InvalidArgumentError("cuda backend: timing_sample_every must be >= 0");
  }
  return absl::OkStatus();
}

}  // namespace

bool CudaDeviceAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

absl::StatusOr<std::unique_ptr<CudaBackend>> MakeCudaBackend(const ModelSpan& model,
                                                             const CudaBackendOptions& options) {
  LS_RETURN_IF_ERROR(ValidateOptions(model, options));
  int device_count = 0;
  LS_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&device_count));
  if (options.device < 0 || options.device >= device_count) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: device ", options.device,
                                                   " does not exist (", device_count, " devices)"));
  }
  LS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  cudaDeviceProp props{};
  LS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, options.device));

  const bool moe = model.config.IsMixtureOfExperts();
  if (moe) LS_RETURN_IF_ERROR(cuda::CheckExpertsCanRun(model.config, props));
  LS_RETURN_IF_ERROR(cuda::CheckFp8CanRun(model.config, props));
  const kernels::DType dtype = cuda::ActivationDTypeFor(model);
  LS_ASSIGN_OR_RETURN(cuda::DeviceWeights weights, cuda::DeviceWeights::Upload(model, dtype));
  const cuda::LayerShape shape = cuda::LayerShape::FromConfig(model.config, dtype);
  LogStream gemm_log(LogLevel::kInfo);  // the tuning table, one record per line
  const std::vector<cuda::TunedShape> gemm_shapes =
      cuda::TunedShapesFor(shape, weights.layers().front());
  LS_ASSIGN_OR_RETURN(std::unique_ptr<kernels::GemmRouter> gemm,
                      cuda::MakeGemmRouter(options.gemm_mode, gemm_shapes, options.max_batch_tokens,
                                           options.gemm_tuning, gemm_log));
  std::vector<cuda::GemmRoute> gemm_routes =
      cuda::GemmRoutes(*gemm, gemm_shapes, options.max_batch_tokens);
  std::vector<std::unique_ptr<StreamSlot>> slots;
  for (int i = 0; i < options.num_streams; ++i) {
    LS_ASSIGN_OR_RETURN(
        std::unique_ptr<StreamSlot> slot,
        MakeSlot(i, shape, options.max_batch_tokens, static_cast<int>(model.layers.size()),
                 gemm->workspace_bytes(), options.host_copy_threads, options.blocking_wait));
    slots.push_back(std::move(slot));
  }
  // Each layer's sliding window, for flash and paged attention alike; windows
  // past any int32 position are no window at all.
  std::vector<int> windows;
  for (int64_t l = 0; l < static_cast<int64_t>(model.layers.size()); ++l) {
    windows.push_back(static_cast<int>(
        std::min<int64_t>(model.config.AttentionWindow(model.first_layer + l), INT32_MAX)));
  }
  auto backend = std::make_unique<CudaBackendImpl>(options, model.config, std::move(windows),
                                                   props.name, std::move(weights), std::move(gemm),
                                                   std::move(gemm_routes), dtype, std::move(slots));
  if (options.warm_up) LS_RETURN_IF_ERROR(backend->WarmUp());
  const absl::StatusOr<int64_t> used = backend->DeviceMemoryUsedBytes();
  LogInfo(absl::StrCat(
      "cuda backend: device ", options.device, " (", props.name, ", sm_", props.major, props.minor,
      ", ", props.multiProcessorCount, " SMs); ",
      model.config.fp8 ? absl::StrCat(model.config.fp8->Describe(), " weights (the FP8 GEMM), ",
                                      ToAbsl(KernelDTypeName(dtype)), " activations, ")
                       : absl::StrCat(ToAbsl(KernelDTypeName(dtype)), " weights, "),
      backend->WeightBytes(), " bytes uploaded for ", model.layers.size(), " layers; ",
      options.num_streams, " streams, ", backend->ActivationBytes(),
      " activation bytes for max_batch_tokens=", options.max_batch_tokens,
      "; CUDA graphs for batches of up to ", options.cuda_graph_max_tokens,
      " tokens; device memory used ", used.ok() ? absl::StrCat(*used) : "unknown", " bytes"));
  return std::unique_ptr<CudaBackend>(std::move(backend));
}

}  // namespace layerserve
