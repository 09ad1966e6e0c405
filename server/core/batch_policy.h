// When to run a batch, and which requests go in it: a pure function of the
// queue and the time, so it is tested exhaustively without threads or sleeps.
//
// Token-level policy: requests are taken in arrival order while their tokens
// fit in max_batch_tokens. A batch runs now when the device is idle (no batch
// of this server is computing: waiting could only add latency, since nothing
// would finish sooner for it), when it is full (its tokens reach the limit,
// or the next request would not fit), or when the oldest queued request has
// waited max_queue_delay; otherwise the batcher sleeps until the oldest
// request's deadline for batching (the delay is measured from the oldest
// request, never restarted). So by default the delay only applies while the
// device is busy, where it lets the next batch grow instead of starting a
// small one beside the running one (BatchPolicy::delay_when_idle: always).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>

#include "server/core/clock.h"

namespace layerserve {

struct BatchPolicy {
  int64_t max_batch_tokens = 8192;
  std::chrono::microseconds max_queue_delay{500};
  // Wait for max_queue_delay even when the device is idle, as Triton's
  // dynamic batcher does: larger batches at moderate load, for up to the
  // delay of added latency. Off by default (--batch-delay-when-idle).
  bool delay_when_idle = false;
};

struct BatchDecision {
  // Requests to take from the front of the queue now; 0 means wait.
  size_t take = 0;
  // When waiting with a non-empty queue: the time at which the oldest request
  // will have waited max_queue_delay. Unset when the queue is empty or take > 0.
  std::optional<SteadyTime> wake_at;
};

// `queued_tokens`: tokens of each queued request, oldest first; each must be in
// [1, max_batch_tokens] (validation guarantees it). `oldest_enqueue`: when the
// first one was queued. `device_idle`: no batch is in flight.
BatchDecision DecideBatch(const BatchPolicy& policy, std::span<const int64_t> queued_tokens,
                          SteadyTime oldest_enqueue, SteadyTime now, bool device_idle);

}  // namespace layerserve
