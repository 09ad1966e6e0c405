// Token-level batch formation (see batch_policy.h).
#include "server/core/batch_policy.h"

#include <algorithm>
#include <bit>

namespace layerserve {
namespace {

// Whether the device waits for `cohort` (the hold is on and would merge it
// with the queued tokens into one batch).
bool Hold(const BatchPolicy& policy, int64_t queued_tokens, const Cohort& cohort, bool merge) {
  return merge && policy.cohort_wait.count() > 0 && !policy.delay_when_idle &&
         cohort.awaited > 0 && queued_tokens + cohort.awaited_tokens <= policy.max_batch_tokens;
}

}  // namespace

BatchDecision DecideBatch(const BatchPolicy& policy, std::span<const int64_t> queued_tokens,
                          SteadyTime oldest_enqueue, SteadyTime now, bool device_idle,
                          std::optional<SteadyTime> device_free_at, const Cohort& cohort,
                          bool merge_cohorts) {
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
    if (now < hold_until && Hold(policy, tokens, cohort, merge_cohorts)) {
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
    // the running batch's cohort is to be waited for, only the bound: the
    // batch's end wakes the scheduler, and the idle rule above decides again.
    const SteadyTime bound =
        oldest_enqueue + std::max(policy.max_device_wait, policy.max_queue_delay);
    due = Hold(policy, tokens, cohort, merge_cohorts)
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

size_t BatchDurationModel::Class(int64_t tokens) {
  const auto n = static_cast<uint64_t>(std::max<int64_t>(tokens, 1));
  const int octave = std::bit_width(n) - 1;  // floor(log2 n)
  if (octave < 2) return n;                  // 1, 2, 3
  // Four classes per doubling, by the two bits below the leading one.
  return 4 * static_cast<size_t>(octave) + ((n >> (octave - 2)) & 3);
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

void CohortModes::Switch(bool merge, bool trial, SteadyTime now) {
  merge_ = merge;
  trial_ = trial;
  since_ = now;
  batches_ = 0;
  seconds_sum_ = 0;
  requests_ = 0;
}

void CohortModes::OnBatch(int64_t requests, double mean_seconds, SteadyTime now) {
  if (!started_) {
    started_ = true;
    since_ = now;
  }
  if (requests > 0 && ++batches_ > policy_.cohort_settle_batches) {
    seconds_sum_ += mean_seconds * static_cast<double>(requests);
    requests_ += requests;
  }
  const bool over = trial_ ? batches_ >= policy_.cohort_settle_batches + policy_.cohort_trial_batches
                           : now - since_ >= policy_.cohort_trial_every;
  if (!over) return;
  if (requests_ > 0) mean_[merge_ ? 1 : 0] = seconds_sum_ / static_cast<double>(requests_);
  if (!trial_) {
    Switch(!merge_, /*trial=*/true, now);  // try the other mode
    return;
  }
  // A trial ended: keep the mode whose requests spent less time in the
  // server, merging only by a margin.
  const double turns = mean_[0], merged = mean_[1];
  const bool merge = turns >= 0 && merged >= 0 && merged < turns * (1 - kMergeMargin);
  Switch(merge, /*trial=*/false, now);
}

}  // namespace layerserve
