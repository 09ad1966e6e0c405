// The CudaBackend that MakeCudaBackend builds (cuda_backend.h): a pool of
// streams, each with one worker thread that takes the next queued batch and
// runs it on its stream (RunBatch: BatchStaging::Pack, BatchLaunch, wait for
// the stream's event, BatchStaging::Unpack); the KV pool the streams share;
// the backend's health; the warm-up before serving.
//
// Sessions: the KV pool (kv_pool.h) is allocated once by AllocateKvCache and
// shared by every stream. Two batches in flight never touch the same block:
// a session has one step in flight at a time, and the session table gives
// every sequence its own blocks. A session's next step runs only after the
// previous one's completion event, so it reads what that step stored.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "server/core/backend.h"
#include "server/cuda/cuda_backend.h"
#include "server/cuda/device_weights.h"
#include "server/cuda/gemm_tuning.h"
#include "server/cuda/kv_pool.h"
#include "server/cuda/layer_executor.h"
#include "server/cuda/stream_slot.h"
#include "server/model/model.h"

namespace layerserve::cuda {

class StreamPool final : public CudaBackend {
 public:
  // Starts one worker per slot.
  StreamPool(const CudaBackendOptions& options, const LlamaConfig& config, std::vector<int> windows,
             std::string device_name, DeviceWeights weights,
             std::unique_ptr<kernels::GemmRouter> gemm, std::vector<GemmRoute> gemm_routes,
             kernels::DType dtype, kernels::DeviceInfo device,
             std::vector<std::unique_ptr<StreamSlot>> slots);
  // Stops the workers once the queue is drained.
  ~StreamPool() override;

  std::string_view Name() const override { return "cuda"; }
  std::string Device() const override { return device_name_; }
  int MaxInflightBatches() const override { return static_cast<int>(slots_.size()); }
  void Execute(std::shared_ptr<Batch> batch, std::function<void(absl::Status)> done) override;
  absl::Status Health() const override;
  size_t WeightBytes() const override { return weights_.bytes(); }
  size_t ActivationBytes() const override { return activation_bytes_; }
  const std::vector<GemmRoute>& GemmRoutes() const override { return gemm_routes_; }
  absl::StatusOr<int64_t> DeviceMemoryUsedBytes() const override;
  // K and V of every layer, in the activation dtype (2 bytes).
  int64_t KvBlockBytes(int64_t block_tokens) const override;
  // What the device has free now (after the weights and the stream pool,
  // and before the KV pool), less a reserve for what is allocated later.
  int64_t KvMemoryAvailable() const override;
  absl::Status AllocateKvCache(const KvCacheShape& shape) override;

  // Runs batches of zeros of every size the load will form, before serving
  // (see the definition).
  absl::Status WarmUp();

 private:
  struct Job {
    std::shared_ptr<Batch> batch;
    std::function<void(absl::Status)> done;
  };

  absl::Status WarmUpSessions(const KvCacheShape& shape);
  // One per stream: runs queued batches until shutdown, then drains the
  // queue so every `done` is called exactly once.
  void WorkerLoop(StreamSlot& slot);
  absl::Status RunBatch(StreamSlot& slot, Batch& batch);
  // Drains the stream (so no launched work still touches the slot's
  // buffers when the next batch packs into them) and classifies the
  // failure: a sticky error marks the backend unhealthy for good.
  absl::Status BatchFailed(StreamSlot& slot, int64_t tokens, const absl::Status& cause);

  const CudaBackendOptions options_;
  const LlamaConfig config_;
  const std::string device_name_;
  const DeviceWeights weights_;
  const std::unique_ptr<kernels::GemmRouter> gemm_;
  const std::vector<GemmRoute> gemm_routes_;
  const LayerExecutor executor_;
  const std::vector<std::unique_ptr<StreamSlot>> slots_;
  size_t activation_bytes_ = 0;
  std::atomic<uint64_t> batches_{0};
  std::atomic<int> computing_{0};        // batches between their launch and their end
  std::atomic<bool> warming_up_{false};  // a warm-up batch is running (before serving)

  // Set once by AllocateKvCache, never replaced (see there).
  Mutex kv_mu_;
  std::unique_ptr<KvPool> kv_pool_ ABSL_GUARDED_BY(kv_mu_);

  mutable Mutex health_mu_;
  absl::Status health_ ABSL_GUARDED_BY(health_mu_);

  Mutex mu_;
  CondVar work_cv_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;  // last: started once everything above exists
};

}  // namespace layerserve::cuda
