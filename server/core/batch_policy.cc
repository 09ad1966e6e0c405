// Token-level batch formation (see batch_policy.h).
#include "server/core/batch_policy.h"

namespace layerserve {

BatchDecision DecideBatch(const BatchPolicy& policy, std::span<const int64_t> queued_tokens,
                          SteadyTime oldest_enqueue, SteadyTime now, bool device_idle) {
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
  const SteadyTime due = oldest_enqueue + policy.max_queue_delay;
  if ((device_idle && !policy.delay_when_idle) || full || now >= due) {
    decision.take = take;
  } else {
    decision.wake_at = due;
  }
  return decision;
}

}  // namespace layerserve
