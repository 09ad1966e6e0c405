// DecideBatch is a pure function: every case is a queue, a time, an answer.
#include "server/core/batch_policy.h"

#include <gtest/gtest.h>

#include <limits>
#include <vector>

namespace layerserve {
namespace {

using std::chrono::microseconds;

const SteadyTime kT0 = SteadyTime{} + std::chrono::seconds(100);
// Whether a batch of the server is in flight (DecideBatch's device_idle).
constexpr bool kBusy = false;
constexpr bool kIdle = true;

BatchPolicy Policy(int64_t max_tokens, int64_t delay_us) {
  return BatchPolicy{max_tokens, microseconds(delay_us)};
}

TEST(BatchPolicyTest, EmptyQueueWaitsWithoutDeadline) {
  const BatchDecision d = DecideBatch(Policy(64, 500), {}, kT0, kT0, kBusy);
  EXPECT_EQ(d.take, 0u);
  EXPECT_FALSE(d.wake_at.has_value());
}

TEST(BatchPolicyTest, PartialBatchWaitsUntilOldestIsDue) {
  const std::vector<int64_t> q = {4, 4};
  const BatchDecision d = DecideBatch(Policy(64, 500), q, kT0, kT0 + microseconds(100), kBusy);
  EXPECT_EQ(d.take, 0u);
  ASSERT_TRUE(d.wake_at.has_value());
  // Measured from the oldest request, not from now.
  EXPECT_EQ(*d.wake_at, kT0 + microseconds(500));
}

TEST(BatchPolicyTest, PartialBatchRunsOnceOldestIsDue) {
  const std::vector<int64_t> q = {4, 4, 1};
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0 + microseconds(500), kBusy).take, 3u);
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0 + microseconds(9999), kBusy).take, 3u);
}

TEST(BatchPolicyTest, FullByTokensRunsAtOnce) {
  const std::vector<int64_t> q = {32, 32};
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0, kBusy).take, 2u);
}

TEST(BatchPolicyTest, TakesLongestPrefixThatFits) {
  // 30 + 30 fit in 64; the third would overflow, so the batch is full now.
  const std::vector<int64_t> q = {30, 30, 10, 1};
  const BatchDecision d = DecideBatch(Policy(64, 500), q, kT0, kT0, kBusy);
  EXPECT_EQ(d.take, 2u);
  EXPECT_FALSE(d.wake_at.has_value());
}

TEST(BatchPolicyTest, NeverSkipsAheadOfALargeRequest) {
  // Arrival order is kept: the 60-token request waits for the next batch even
  // though the 1-token request behind it would fit.
  const std::vector<int64_t> q = {10, 60, 1};
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0, kBusy).take, 1u);
}

TEST(BatchPolicyTest, SingleRequestAtTheLimitRunsAlone) {
  const std::vector<int64_t> q = {64, 1};
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0, kBusy).take, 1u);
}

TEST(BatchPolicyTest, ZeroDelayRunsImmediately) {
  const std::vector<int64_t> q = {1};
  EXPECT_EQ(DecideBatch(Policy(64, 0), q, kT0, kT0, kBusy).take, 1u);
}

TEST(BatchPolicyTest, BatchOfOneTokenPerRequestIsBoundedByTokens) {
  std::vector<int64_t> q(100, 1);
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0, kBusy).take, 64u);
}

TEST(BatchPolicyTest, IdleDeviceRunsAPartialBatchAtOnce) {
  // Nothing is computing, so waiting for the delay would only add latency.
  const std::vector<int64_t> q = {1, 3};
  const BatchDecision d = DecideBatch(Policy(64, 500), q, kT0, kT0, kIdle);
  EXPECT_EQ(d.take, 2u);
  EXPECT_FALSE(d.wake_at.has_value());
}

TEST(BatchPolicyTest, IdleDeviceStillBoundsTheBatchByTokens) {
  const std::vector<int64_t> q = {40, 40, 1};
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0, kIdle).take, 1u);
}

TEST(BatchPolicyTest, IdleDeviceWithEmptyQueueWaits) {
  const BatchDecision d = DecideBatch(Policy(64, 500), {}, kT0, kT0, kIdle);
  EXPECT_EQ(d.take, 0u);
  EXPECT_FALSE(d.wake_at.has_value());
}

TEST(BatchPolicyTest, DelayWhenIdleWaitsOnAnIdleDeviceToo) {
  // Triton's dynamic batcher's rule (--batch-delay-when-idle).
  BatchPolicy policy = Policy(64, 500);
  policy.delay_when_idle = true;
  const std::vector<int64_t> q = {1, 3};
  const BatchDecision d = DecideBatch(policy, q, kT0, kT0 + microseconds(100), kIdle);
  EXPECT_EQ(d.take, 0u);
  ASSERT_TRUE(d.wake_at.has_value());
  EXPECT_EQ(*d.wake_at, kT0 + microseconds(500));
  EXPECT_EQ(DecideBatch(policy, q, kT0, kT0 + microseconds(500), kIdle).take, 2u);
}

// Just in time: the device is busy and its batch's end is predicted.

TEST(BatchPolicyTest, JustInTimeWaitsPastTheDelayForTheRunningBatch) {
  // The running batch ends at +900 us: rather than start a small batch
  // beside it at +500 us, the next one forms at +800 us (lead 100 us).
  const std::vector<int64_t> q = {1, 1};
  const SteadyTime free_at = kT0 + microseconds(900);
  const BatchDecision d =
      DecideBatch(Policy(64, 500), q, kT0, kT0 + microseconds(500), kBusy, free_at);
  EXPECT_EQ(d.take, 0u);
  ASSERT_TRUE(d.wake_at.has_value());
  EXPECT_EQ(*d.wake_at, kT0 + microseconds(800));
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0 + microseconds(800), kBusy, free_at).take, 2u);
}

TEST(BatchPolicyTest, JustInTimeFormsBeforeTheDelayWhenTheBatchEndsFirst) {
  const std::vector<int64_t> q = {1};
  const SteadyTime free_at = kT0 + microseconds(300);
  const BatchDecision d = DecideBatch(Policy(64, 500), q, kT0, kT0, kBusy, free_at);
  ASSERT_TRUE(d.wake_at.has_value());
  EXPECT_EQ(*d.wake_at, kT0 + microseconds(200));
}

TEST(BatchPolicyTest, JustInTimeWaitIsBounded) {
  // A long batch (a prefill chunk, 10 ms) runs: the oldest request waits at
  // most max_device_wait, then runs beside it.
  const std::vector<int64_t> q = {1};
  const SteadyTime free_at = kT0 + microseconds(10000);
  const BatchDecision d = DecideBatch(Policy(64, 500), q, kT0, kT0, kBusy, free_at);
  ASSERT_TRUE(d.wake_at.has_value());
  EXPECT_EQ(*d.wake_at, kT0 + microseconds(2000));
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0 + microseconds(2000), kBusy, free_at).take,
            1u);
}

TEST(BatchPolicyTest, JustInTimeNeverWaitsLessThanTheDelayBound) {
  // A delay above max_device_wait: the larger of the two bounds applies.
  const std::vector<int64_t> q = {1};
  const SteadyTime free_at = kT0 + microseconds(10000);
  const BatchDecision d = DecideBatch(Policy(64, 3000), q, kT0, kT0, kBusy, free_at);
  ASSERT_TRUE(d.wake_at.has_value());
  EXPECT_EQ(*d.wake_at, kT0 + microseconds(3000));
}

TEST(BatchPolicyTest, JustInTimeOverdueBatchRunsNow) {
  // The running batch is past its predicted end: nothing better to wait for.
  const std::vector<int64_t> q = {1};
  EXPECT_EQ(
      DecideBatch(Policy(64, 500), q, kT0, kT0 + microseconds(50), kBusy, kT0 + microseconds(20))
          .take,
      1u);
}

TEST(BatchPolicyTest, JustInTimeStillRunsAFullBatchAtOnce) {
  const std::vector<int64_t> q = {40, 30};
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0, kBusy, kT0 + microseconds(5000)).take, 1u);
}

TEST(BatchPolicyTest, JustInTimeOffKeepsTheDelay) {
  const std::vector<int64_t> q = {1};
  const SteadyTime free_at = kT0 + microseconds(900);
  BatchPolicy off = Policy(64, 500);
  off.max_device_wait = microseconds(0);
  EXPECT_EQ(*DecideBatch(off, q, kT0, kT0, kBusy, free_at).wake_at, kT0 + microseconds(500));
  // Triton's rule (delay also when idle) is the delay alone too.
  BatchPolicy triton = Policy(64, 500);
  triton.delay_when_idle = true;
  EXPECT_EQ(*DecideBatch(triton, q, kT0, kT0, kBusy, free_at).wake_at, kT0 + microseconds(500));
}

BatchPolicy HoldPolicy(int64_t cohort_wait_us) {
  BatchPolicy policy = Policy(64, 500);
  policy.cohort_wait = microseconds(cohort_wait_us);
  return policy;
}

Cohort Owed(int64_t requests) {
  return {.answered_at = kT0, .awaited = requests, .awaited_tokens = requests};
}

constexpr bool kMerge = true;
constexpr bool kTurns = false;

BatchDecision Idle(size_t queued, int64_t owed, bool merge, SteadyTime now = kT0) {
  const std::vector<int64_t> q(queued, 1);
  return DecideBatch(HoldPolicy(1000), q, kT0, now, kIdle, std::nullopt, Owed(owed), merge);
}

TEST(BatchPolicyTest, CohortHoldWaitsForTheAnsweredRequestsWhenMerging) {
  const BatchDecision d = Idle(4, 4, kMerge);
  EXPECT_EQ(d.take, 0u);
  ASSERT_TRUE(d.wake_at.has_value());
  // The bound, counted from the batch's end; the cohort's return wakes the
  // batcher sooner.
  EXPECT_EQ(*d.wake_at, kT0 + microseconds(1000));
  // However the clients are split when the batch ends.
  EXPECT_EQ(Idle(1, 63, kMerge).take, 0u);
}

TEST(BatchPolicyTest, CohortHoldTakingTurnsRunsAtOnce) { EXPECT_EQ(Idle(4, 4, kTurns).take, 4u); }

TEST(BatchPolicyTest, CohortBackRunsAtOnce) { EXPECT_EQ(Idle(8, 0, kMerge).take, 8u); }

TEST(BatchPolicyTest, CohortHoldIsBounded) {
  // Whoever is owed and not back by then is not waited for.
  EXPECT_EQ(Idle(4, 4, kMerge, kT0 + microseconds(1000)).take, 4u);
}

TEST(BatchPolicyTest, CohortHoldOffRunsAnIdleDeviceAtOnce) {
  const std::vector<int64_t> q(4, 1);
  EXPECT_EQ(DecideBatch(HoldPolicy(0), q, kT0, kT0, kIdle, std::nullopt, Owed(4), kMerge).take, 4u);
  // Triton's rule replaces it: the delay, counted from the oldest request.
  BatchPolicy triton = HoldPolicy(1000);
  triton.delay_when_idle = true;
  EXPECT_EQ(*DecideBatch(triton, q, kT0, kT0, kIdle, std::nullopt, Owed(4), kMerge).wake_at,
            kT0 + microseconds(500));
}

TEST(BatchPolicyTest, CohortHoldStillRunsAFullBatchAtOnce) {
  const std::vector<int64_t> q = {40, 30};
  EXPECT_EQ(DecideBatch(HoldPolicy(1000), q, kT0, kT0, kIdle, std::nullopt, Owed(4), kMerge).take,
            1u);
  // Nor does it wait for a cohort that would not fit one batch with the queue.
  const std::vector<int64_t> big = {60};
  EXPECT_EQ(
      DecideBatch(HoldPolicy(1000), big, kT0, kT0, kIdle, std::nullopt, Owed(8), kMerge).take, 1u);
}

TEST(BatchPolicyTest, CohortHoldWaitsForTheRunningBatchToEnd) {
  // A batch of 4 runs until kT0; four more requests are queued. Merging: not
  // formed just in time (kT0 - 100 us); only the bound wakes the scheduler,
  // and the batch's end does, through the batcher.
  const std::vector<int64_t> q(4, 1);
  const SteadyTime queued = kT0 - microseconds(500);
  const BatchDecision held = DecideBatch(HoldPolicy(1000), q, queued, kT0 - microseconds(200),
                                         kBusy, kT0, Owed(4), kMerge);
  EXPECT_EQ(held.take, 0u);
  ASSERT_TRUE(held.wake_at.has_value());
  EXPECT_EQ(*held.wake_at, queued + microseconds(2000));
  // Taking turns: just in time as without the hold.
  const BatchDecision in_time = DecideBatch(HoldPolicy(1000), q, queued, kT0 - microseconds(200),
                                            kBusy, kT0, Owed(4), kTurns);
  ASSERT_TRUE(in_time.wake_at.has_value());
  EXPECT_EQ(*in_time.wake_at, kT0 - microseconds(100));
}

// CohortModes with a trial of 4 counted batches after 1 settling one, every
// 10 ms.
BatchPolicy TrialPolicy() {
  BatchPolicy policy = HoldPolicy(1000);
  policy.cohort_trial_every = std::chrono::milliseconds(10);
  policy.cohort_trial_batches = 4;
  policy.cohort_settle_batches = 1;
  return policy;
}

// Feeds `batches` batches of 8 requests that spent `ms` each in the server,
// 1 ms apart, starting at *now.
void Feed(CohortModes& modes, int batches, double ms, SteadyTime* now) {
  for (int i = 0; i < batches; ++i) {
    *now += std::chrono::milliseconds(1);
    modes.OnBatch(8, ms / 1e3, *now);
  }
}

TEST(CohortModesTest, TakesTurnsThenTriesMergingAndKeepsTheFaster) {
  CohortModes modes(TrialPolicy());
  SteadyTime now = kT0;
  EXPECT_FALSE(modes.merge());  // without a measurement: as without the hold
  Feed(modes, 10, 2.0, &now);   // 10 ms of turns
  EXPECT_FALSE(modes.merge());
  Feed(modes, 1, 2.0, &now);  // the phase is over: merging on trial
  EXPECT_TRUE(modes.merge());
  // The first batch of the trial settles and does not count (a slow one).
  Feed(modes, 1, 50.0, &now);
  Feed(modes, 3, 1.5, &now);
  EXPECT_TRUE(modes.merge());
  Feed(modes, 1, 1.5, &now);  // trial over: 1.5 ms against 2.0
  EXPECT_TRUE(modes.merge());
  // Merging is now the chosen mode; after its 10 ms, taking turns is tried
  // again, and wins back when it is faster.
  Feed(modes, 10, 1.5, &now);
  EXPECT_FALSE(modes.merge());
  Feed(modes, 5, 1.0, &now);
  EXPECT_FALSE(modes.merge());
  Feed(modes, 10, 1.0, &now);  // turns chosen; merging on trial again
  EXPECT_TRUE(modes.merge());
}

TEST(CohortModesTest, MergingMustWinByTheMargin) {
  CohortModes modes(TrialPolicy());
  SteadyTime now = kT0;
  Feed(modes, 11, 2.0, &now);
  ASSERT_TRUE(modes.merge());
  Feed(modes, 5, 2.0 * (1 - CohortModes::kMergeMargin / 2), &now);  // 1.5% better: not enough
  EXPECT_FALSE(modes.merge());
}

TEST(BatchDurationModelTest, PredictsNothingForAClassNotSeen) {
  BatchDurationModel model;
  EXPECT_FALSE(model.Predict(1).has_value());
  model.Observe(1, microseconds(800));
  ASSERT_TRUE(model.Predict(1).has_value());
  EXPECT_EQ(*model.Predict(1), microseconds(800));
  // Below 8 every size is its own class; from there, four per doubling.
  EXPECT_FALSE(model.Predict(2).has_value());
  model.Observe(33, microseconds(900));
  EXPECT_EQ(*model.Predict(32), microseconds(900));
  EXPECT_EQ(*model.Predict(39), microseconds(900));
  EXPECT_FALSE(model.Predict(31).has_value());
  EXPECT_FALSE(model.Predict(40).has_value());
  model.Observe(std::numeric_limits<int64_t>::max(), microseconds(5));
  EXPECT_EQ(*model.Predict(std::numeric_limits<int64_t>::max()), microseconds(5));
  EXPECT_FALSE(model.Predict(4096).has_value());
}

TEST(BatchDurationModelTest, MovesTowardNewSamples) {
  BatchDurationModel model;
  model.Observe(16, microseconds(1000));
  model.Observe(16, microseconds(2000));
  // 1000 + 0.2 x (2000 - 1000)
  const double us = std::chrono::duration<double, std::micro>(*model.Predict(16)).count();
  EXPECT_NEAR(us, 1200.0, 1e-6);
}

}  // namespace
}  // namespace layerserve
