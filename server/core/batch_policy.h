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
//
// Just in time (BatchPolicy::max_device_wait > 0): while a batch computes and
// its end can be predicted (BatchDurationModel), the next batch is formed
// when that end is device_lead away, not when max_queue_delay runs out. Two
// small batches computing side by side each read every weight of the span,
// so together they take nearly twice as long as one; formed just in time,
// the next batch holds every request that arrived meanwhile and starts as
// the running one ends, with its host work (copies, launches) done during
// the running one's last device_lead. A request waits for a running batch at
// most max_device_wait (a long prefill chunk); past that it runs beside it.
#pragma once

#include <array>
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
  // delay of added latency. Off by default (--batch-delay-when-idle). It also
  // turns just-in-time formation off: the delay alone decides.
  bool delay_when_idle = false;
  // Just in time (see the file comment): the longest the oldest request
  // waits for a running batch to end; 0 turns it off (--max-device-wait-us).
  std::chrono::microseconds max_device_wait{2000};
  // How long before the running batch's predicted end the next one is
  // formed, so that its host work overlaps the running batch's tail
  // (--device-lead-us).
  std::chrono::microseconds device_lead{100};
};

struct BatchDecision {
  // Requests to take from the front of the queue now; 0 means wait.
  size_t take = 0;
  // When waiting with a non-empty queue: when the decision may change by
  // itself (the oldest request due, or the running batch about to end).
  // Unset when the queue is empty or take > 0.
  std::optional<SteadyTime> wake_at;
};

// `queued_tokens`: tokens of each queued request, oldest first; each must be in
// [1, max_batch_tokens] (validation guarantees it). `oldest_enqueue`: when the
// first one was queued. `device_idle`: no batch is in flight.
// `device_free_at`: when the batches in flight are predicted to have ended
// (unset: idle, or no prediction yet, and then max_queue_delay alone decides).
BatchDecision DecideBatch(const BatchPolicy& policy, std::span<const int64_t> queued_tokens,
                          SteadyTime oldest_enqueue, SteadyTime now, bool device_idle,
                          std::optional<SteadyTime> device_free_at = std::nullopt);

// How long a batch computes, learned from the batches that ran: an
// exponential moving average per size class, the classes being powers of two
// of tokens (1, 2-3, 4-7, ...), since on a GPU a memory-bound batch of 3
// tokens costs what one of 2 does and a 4096-token one far more. Not
// thread-safe: the batcher holds it under its lock.
class BatchDurationModel {
 public:
  // Weight of the newest sample in the average.
  static constexpr double kSmoothing = 0.2;

  // Records that a batch of `tokens` (>= 1) computed for `duration`.
  void Observe(int64_t tokens, SteadyTime::duration duration);
  // The average for batches of `tokens`'s class; unset before one of that
  // class has been observed (a first prefill must not be predicted from
  // decode steps).
  std::optional<SteadyTime::duration> Predict(int64_t tokens) const;

 private:
  static size_t Class(int64_t tokens);
  std::array<double, 64> seconds_{};  // 0: no sample yet
};

}  // namespace layerserve
