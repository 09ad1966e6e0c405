// Token-level batch formation (see batch_policy.h).
#include "server/core/batch_policy.h"

#include <algorithm>
#include <bit>

namespace layerserve {
namespace {

// Whether holding the device for `cohort` finishes the queued tokens and the
// cohort's sooner than computing the queued ones as soon as the device is
// free (at `start`) and the cohort after them. With the merged batch's cost
// not known yet, holding is tried, so that the next decision knows it.
bool HoldPays(const BatchPolicy& policy, int64_t queued, const Cohort& cohort, SteadyTime start,
              const BatchDurationModel* compute) {
  if (policy.cohort_wait.count() <= 0 || policy.delay_when_idle || cohort.awaited <= 0 ||
      !cohort.back_after || *cohort.back_after > policy.cohort_wait || compute == nullptr ||
      queued + cohort.awaited_tokens > policy.max_batch_tokens) {
    return false;  // also when the two would not fit one batch
  }
  const SteadyTime back = cohort.answered_at + *cohort.back_after;
  const std::optional<SteadyTime::duration> merged =
      compute->Predict(queued + cohort.awaited_tokens);
  const std::optional<SteadyTime::duration> alone = compute->Predict(queued);
  const std::optional<SteadyTime::duration> after = compute->Predict(cohort.awaited_tokens);
  if (!merged || !alone || !after) return true;
  // Not holding, the cohort's batch starts when the queued one ends or when
  // the cohort is back, whichever is later.
  const SteadyTime held = std::max(back, start) + *merged;
  const SteadyTime in_turns = std::max(start + *alone, back) + *after;
  return held < in_turns;
}

}  // namespace

BatchDecision DecideBatch(const BatchPolicy& policy, std::span<const int64_t> queued_tokens,
                          SteadyTime oldest_enqueue, SteadyTime now, bool device_idle,
                          std::optional<SteadyTime> device_free_at, const Cohort& cohort,
                          const BatchDurationModel* compute) {
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
    if (now < hold_until && HoldPays(policy, tokens, cohort, now, compute)) {
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
    due = HoldPays(policy, tokens, cohort, *device_free_at, compute)
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
