// DecideBatch is a pure function: every case is a queue, a time, an answer.
#include "server/core/batch_policy.h"

#include <gtest/gtest.h>

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

TEST(BatchDurationModelTest, PredictsNothingForAClassNotSeen) {
  BatchDurationModel model;
  EXPECT_FALSE(model.Predict(1).has_value());
  model.Observe(1, microseconds(800));
  ASSERT_TRUE(model.Predict(1).has_value());
  EXPECT_EQ(*model.Predict(1), microseconds(800));
  // 2 and 3 tokens share a class; 1 is its own, as is 4-7.
  EXPECT_FALSE(model.Predict(2).has_value());
  model.Observe(3, microseconds(900));
  EXPECT_EQ(*model.Predict(2), microseconds(900));
  EXPECT_FALSE(model.Predict(4).has_value());
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
