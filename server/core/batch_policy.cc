// Token-level batch formation (see batch_policy.h).
#include "server/core/batch_policy.h"

#include <algorithm>
#include <bit>

namespace layerserve {
namespace {

// Whether the closed loop of the queued requests and the cohort owed (its
// population: n requests, all of which come back each round) runs faster as
// one batch per round, waiting for everyone, than as two halves taking
// turns, each half's round trip hidden behind the other's compute:
//
//   one batch:   a round is compute(n) + return(n);
//   two halves:  a round is max(2 compute(n/2), compute(n/2) + return(n/2)).
//
// Priced on the population, not on the queue at hand, so the answer does not
// flip with how the requests happen to be split at this moment (with one
// request queued and the rest owed, running it alone always looks free).
// With a merged batch's times not learned yet (and the halves' known),
// holding is tried once.
bool HoldPays(const BatchPolicy& policy, int64_t queued_requests, int64_t queued_tokens,
              const Cohort& cohort, const LearnedTimes& learned) {
  if (policy.cohort_wait.count() <= 0 || policy.delay_when_idle || cohort.awaited <= 0 ||
      learned.compute == nullptr || learned.returns == nullptr) {
    return false;
  }
  const int64_t tokens = queued_tokens + cohort.awaited_tokens;
  const int64_t requests = queued_requests + cohort.awaited;
  if (tokens > policy.max_batch_tokens) return false;  // not one batch anyway
  const std::optional<SteadyTime::duration> half_back =
      learned.returns->Predict((requests + 1) / 2);
  // Nothing known of the loop yet, or it is slower than the hold's bound (a
  // pipeline stage waiting on the next): take turns.
  if (!half_back || *half_back > policy.cohort_wait) return false;
  const std::optional<SteadyTime::duration> half = learned.compute->Predict((tokens + 1) / 2);
  // Turns are what runs without the hold, so their times come by themselves;
  // trying the hold before they are known would merge every batch from then
  // on, and the halves would never be learned.
  if (!half) return false;
  const std::optional<SteadyTime::duration> all_back = learned.returns->Predict(requests);
  const std::optional<SteadyTime::duration> all = learned.compute->Predict(tokens);
  if (!all_back || !all) return true;
  if (*all_back > policy.cohort_wait) return false;
  return *all + *all_back < std::max(2 * *half, *half + *half_back);
}

}  // namespace

BatchDecision DecideBatch(const BatchPolicy& policy, std::span<const int64_t> queued_tokens,
                          SteadyTime oldest_enqueue, SteadyTime now, bool device_idle,
                          std::optional<SteadyTime> device_free_at, const Cohort& cohort,
                          const LearnedTimes& learned) {
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
  if (full) {
    decision.take = take;
    return decision;
  }
  if (device_idle && !policy.delay_when_idle) {
    const SteadyTime hold_until = cohort.answered_at + policy.cohort_wait;
    if (now < hold_until && HoldPays(policy, static_cast<int64_t>(take), tokens, cohort, learned)) {
      decision.wake_at = hold_until;  // or sooner, when the cohort is back
    } else {
      decision.take = take;
    }
    return decision;
  }
  SteadyTime due = oldest_enqueue + policy.max_queue_delay;
  const bool just_in_time = !device_idle && device_free_at.has_value() &&
                            policy.max_device_wait.count() > 0 && !policy.delay_when_idle;
  if (just_in_time) {
    // Earlier than `due` when the running batch ends first; later, up to the
    // wait bound, when it ends after. Both bounds count from the oldest
    // request, so a request never waits more than the larger of them. When
    // the running batch's cohort is worth holding for, only the bound: the
    // batch's end wakes the scheduler, and the idle rule above decides again.
    const SteadyTime bound =
        oldest_enqueue + std::max(policy.max_device_wait, policy.max_queue_delay);
    due = HoldPays(policy, static_cast<int64_t>(take), tokens, cohort, learned)
              ? bound
              : std::min(*device_free_at - policy.device_lead, bound);
  }
  if (now >= due) {
    decision.take = take;
  } else {
    decision.wake_at = due;
  }
  return decision;
}

size_t BatchDurationModel::Class(int64_t size) {
  const auto n = static_cast<uint64_t>(std::max<int64_t>(size, 1));
  const int octave = std::bit_width(n) - 1;  // floor(log2 n)
  if (octave < 2) return n;                  // 1, 2, 3
  // Four classes per doubling, by the two bits below the leading one.
  return 4 * static_cast<size_t>(octave) + ((n >> (octave - 2)) & 3);
}

void BatchDurationModel::Observe(int64_t size, SteadyTime::duration duration) {
  const double seconds = std::max(std::chrono::duration<double>(duration).count(), 1e-9);
  double& average = seconds_[Class(size)];
  average = average == 0 ? seconds : average + kSmoothing * (seconds - average);
}

std::optional<SteadyTime::duration> BatchDurationModel::Predict(int64_t size) const {
  const double seconds = seconds_[Class(size)];
  if (seconds == 0) return std::nullopt;
  return std::chrono::duration_cast<SteadyTime::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace layerserve
