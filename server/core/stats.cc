// ModelStatistics counters (see stats.h).
#include "server/core/stats.h"

#include <chrono>

namespace layerserve {
namespace {

uint64_t ToNs(double seconds) { return static_cast<uint64_t>(seconds * 1e9 + 0.5); }

}  // namespace

void StatsRecorder::OnRequestFinished(const RequestRecord& r) {
  // Calls for a model this server does not serve are not this model's
  // failures: ModelStatistics reports the served model only.
  if (r.model.empty()) return;
  MutexLock lock(&mu_);
  DurationStat& d = r.code == "OK" ? stats_.success : stats_.fail;
  d.count += 1;
  d.ns += ToNs(r.duration_seconds);
  if (r.code == "OK") {
    stats_.last_inference_ms =
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                  std::chrono::system_clock::now().time_since_epoch())
                                  .count());
  }
}

void StatsRecorder::OnDequeued(const DequeueRecord& r) {
  MutexLock lock(&mu_);
  stats_.queue.count += 1;
  stats_.queue.ns += ToNs(r.queue_seconds);
}

void StatsRecorder::OnBatchExecuted(const BatchRecord& r) {
  if (!r.ok) return;
  MutexLock lock(&mu_);
  const uint64_t ns = ToNs(r.compute_seconds);
  stats_.execution_count += 1;
  stats_.inference_count += static_cast<uint64_t>(r.requests);
  // Every request of the batch spent the batch's compute time, split as the
  // backend measured it (the three parts add up to compute_seconds);
  // perf_analyzer requires the three counts to agree.
  const uint64_t requests = static_cast<uint64_t>(r.requests);
  stats_.compute_input.count += requests;
  stats_.compute_infer.count += requests;
  stats_.compute_output.count += requests;
  stats_.compute_input.ns += ToNs(r.input_seconds) * requests;
  stats_.compute_infer.ns += ToNs(r.infer_seconds()) * requests;
  stats_.compute_output.ns += ToNs(r.output_seconds) * requests;
  DurationStat& per_size = stats_.batch_compute_infer[static_cast<uint64_t>(r.requests)];
  per_size.count += 1;
  per_size.ns += ns;
}

ModelStatsSnapshot StatsRecorder::Snapshot() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace layerserve
