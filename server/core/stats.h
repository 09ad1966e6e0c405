// Cumulative per-model counters in the shape of the Open Inference Protocol's
// ModelStatistics (Triton's extension), which perf_analyzer diffs per
// measurement window to report queue and compute time.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>

#include "absl/base/thread_annotations.h"
#include "base/mutex.h"
#include "server/core/observer.h"

namespace layerserve {

struct DurationStat {
  uint64_t count = 0;
  uint64_t ns = 0;
};

struct ModelStatsSnapshot {
  uint64_t last_inference_ms = 0;  // wall clock, ms since the Unix epoch
  uint64_t inference_count = 0;    // requests run successfully
  uint64_t execution_count = 0;    // batches run
  DurationStat success, fail, queue, compute_input, compute_infer, compute_output;
  // Per batch size (in requests): executions and their compute time.
  std::map<uint64_t, DurationStat> batch_compute_infer;
};

// A ServerObserver that accumulates ModelStatsSnapshot counters. Thread-safe.
class StatsRecorder final : public ServerObserver {
 public:
  void OnRequestFinished(const RequestRecord& r) override;
  void OnDequeued(const DequeueRecord& r) override;
  void OnBatchExecuted(const BatchRecord& r) override;
  ModelStatsSnapshot Snapshot() const;

 private:
  mutable Mutex mu_;
  ModelStatsSnapshot stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layerserve
