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
//
// Cohort hold (BatchPolicy::cohort_wait > 0): for closed loops, where every
// answered request comes back as a new one a round trip later (a client's
// next call, a session's next decode step). Run back to back, such clients
// split into cohorts that take turns on the device; no rule that looks only
// at the queue can tell them from a steady stream of arrivals. Holding the
// device after a batch until its requests are back (for at most
// cohort_wait) merges the cohorts: one batch per round instead of several,
// at the price of the device idling through the round trip. Which of the two
// wins depends on what a batch of twice the tokens costs, on the round trip
// and its spread, and on how the turns overlap on the stream pool; a price
// computed from learned times got it wrong by 40% on one load (docs/perf.md,
// "The cohort hold"). So the batcher measures instead (CohortModes): the
// mean time a request spends in the server, from its arrival to its batch's
// end, in each mode. In a closed loop the time outside the server is the
// same in both, so the mode with the shorter time in the server serves more
// (Little's law); in an open loop it is the lower latency. The batcher keeps
// the better mode and tries the other for a few batches every so often.
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
  // Cohort hold (see the file comment): the longest the device stays idle
  // after a batch, waiting for its requests to come back; 0 turns it off
  // (--cohort-wait-us). Ignored with delay_when_idle.
  std::chrono::microseconds cohort_wait{0};
  // How CohortModes compares the modes: the chosen one runs this long, then
  // the other is tried for cohort_trial_batches batches, of which the first
  // cohort_settle_batches (the switch's own transient) are not counted.
  // Every quarter second, so that a change of load (a prefill phase giving
  // way to decoding) is followed within a few trials.
  std::chrono::milliseconds cohort_trial_every{250};
  int64_t cohort_trial_batches = 16;
  int64_t cohort_settle_batches = 4;
};

// How long a batch computes, learned from the batches that ran: an
// exponential moving average per size class, four classes per doubling (1,
// 2, ..., 7, 8-9, 10-11, ..., 32-39, 40-47, ...): a memory-bound batch of 40
// tokens costs about what one of 32 does, a 4096-token one far more. Not
// thread-safe: the batcher holds it under its lock.
class BatchDurationModel {
 public:
  // Weight of the newest sample in the average.
  static constexpr double kSmoothing = 0.2;

  // Records that a batch of `tokens` (>= 1) computed for `duration`.
  void Observe(int64_t tokens, SteadyTime::duration duration);
  // The average for `tokens`'s class; unset before one of that class has been
  // observed (a first prefill must not be predicted from decode steps).
  std::optional<SteadyTime::duration> Predict(int64_t tokens) const;

 private:
  static size_t Class(int64_t tokens);
  std::array<double, 256> seconds_{};  // 0: no sample yet
};

// The requests of the last batch to end, or of the running one (then
// answered_at is its predicted end), which a closed loop will send back: what
// the cohort hold waits for.
struct Cohort {
  SteadyTime answered_at{};
  int64_t awaited = 0;         // its requests not yet matched by an arrival since
  int64_t awaited_tokens = 0;  // their tokens, as that batch held them
};

// Chooses between taking turns (no hold) and merging cohorts (the hold) by
// what each measured: the mean time its requests spent in the server. It
// starts taking turns; after policy.cohort_trial_every it tries the other
// mode for policy.cohort_trial_batches batches, then keeps whichever had the
// shorter mean (merging must win by kMergeMargin, since taking turns is what
// the batcher does without the hold), and so on. Pure: the batcher reports
// each batch and asks which mode is on. Not thread-safe.
class CohortModes {
 public:
  static constexpr double kMergeMargin = 0.03;

  explicit CohortModes(const BatchPolicy& policy) : policy_(policy) {}

  // Whether the hold is on: merging now, for good or on trial.
  bool merge() const { return merge_; }
  // A batch ended at `now`; its `requests` answered requests spent
  // `mean_seconds` in the server on average (arrival to the batch's end).
  void OnBatch(int64_t requests, double mean_seconds, SteadyTime now);

 private:
  void Switch(bool merge, bool trial, SteadyTime now);

  BatchPolicy policy_;
  bool merge_ = false;
  bool trial_ = false;       // trying the mode not chosen
  SteadyTime since_{};       // when this phase began (its first batch ended)
  bool started_ = false;     // a first batch has been seen
  int64_t batches_ = 0;      // in this phase
  double seconds_sum_ = 0;   // over this phase's counted requests
  int64_t requests_ = 0;
  // The latest phase mean of each mode (turns, merge); negative: none yet.
  std::array<double, 2> mean_{-1, -1};
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
// `merge_cohorts` (CohortModes::merge) turns the cohort hold on: the device
// waits for `cohort`.
BatchDecision DecideBatch(const BatchPolicy& policy, std::span<const int64_t> queued_tokens,
                          SteadyTime oldest_enqueue, SteadyTime now, bool device_idle,
                          std::optional<SteadyTime> device_free_at = std::nullopt,
                          const Cohort& cohort = {}, bool merge_cohorts = false);

}  // namespace layerserve
