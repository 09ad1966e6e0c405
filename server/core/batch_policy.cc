// Token-level batch formation (see batch_policy.h).
#include "server/core/batch_policy.h"

#include <algorithm>
#include <bit>

namespace layerserve {

BatchDecision DecideBatch(const BatchPolicy& policy, std::span<const int64_t> queued_tokens,
                          SteadyTime oldest_enqueue, SteadyTime now, bool device_idle,
                          std::optional<SteadyTime> device_free_at) {
  BatchDecision decision;
  if (queued_tokens.empty()) return decision;

  // Longest arrival-order prefix that fits. The first request always fits:
  // validation bounds every request by max_batch_tokens.
  int64_t tokens = 0;
  size_t take = 0;
  for (const int64_t t : queued_tokens) {
    if (take > 0 && tokens + t > policy.max_batch_tokens) break;
    tokens += t;
    ++take;
  }

  const bool full = tokens >= policy.max_batch_tokens || take < queued_tokens.size();
  if (full || (device_idle && !policy.delay_when_idle)) {
    decision.take = take;
    return decision;
  }
  SteadyTime due = oldest_enqueue + policy.max_queue_delay;
  const bool just_in_time = !device_idle && device_free_at.has_value() &&
                            policy.max_device_wait.count() > 0 && !policy.delay_when_idle;
  if (just_in_time) {
    // Earlier than `due` when the running batch ends first; later, up to the
    // wait bound, when it ends after. Both bounds count from the oldest
    // request, so a request never waits more than the larger of them.
    const SteadyTime bound =
        oldest_enqueue + std::max(policy.max_device_wait, policy.max_queue_delay);
    due = std::min(*device_free_at - policy.device_lead, bound);
  }
  if (now >= due) {
    decision.take = take;
  } else {
    decision.wake_at = due;
  }
  return decision;
}

size_t BatchDurationModel::Class(int64_t tokens) {
  return std::min<size_t>(std::bit_width(static_cast<uint64_t>(std::max<int64_t>(tokens, 1))), 63);
}

void BatchDurationModel::Observe(int64_t tokens, SteadyTime::duration duration) {
  const double seconds = std::max(std::chrono::duration<double>(duration).count(), 1e-9);
  double& average = seconds_[Class(tokens)];
  average = average == 0 ? seconds : average + kSmoothing * (seconds - average);
}

std::optional<SteadyTime::duration> BatchDurationModel::Predict(int64_t tokens) const {
  const double seconds = seconds_[Class(tokens)];
  if (seconds == 0) return std::nullopt;
  return std::chrono::duration_cast<SteadyTime::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace layerserve
