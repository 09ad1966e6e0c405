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

}  // namespace
}  // namespace layerserve
