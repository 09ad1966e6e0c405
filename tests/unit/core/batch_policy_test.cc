// DecideBatch is a pure function: every case is a queue, a time, an answer.
#include "server/core/batch_policy.h"

#include <gtest/gtest.h>

#include <vector>

namespace layerserve {
namespace {

using std::chrono::microseconds;

const SteadyTime kT0 = SteadyTime{} + std::chrono::seconds(100);

BatchPolicy Policy(int64_t max_tokens, int64_t delay_us) {
  return BatchPolicy{max_tokens, microseconds(delay_us)};
}

TEST(BatchPolicyTest, EmptyQueueWaitsWithoutDeadline) {
  const BatchDecision d = DecideBatch(Policy(64, 500), {}, kT0, kT0);
  EXPECT_EQ(d.take, 0u);
  EXPECT_FALSE(d.wake_at.has_value());
}

TEST(BatchPolicyTest, PartialBatchWaitsUntilOldestIsDue) {
  const std::vector<int64_t> q = {4, 4};
  const BatchDecision d = DecideBatch(Policy(64, 500), q, kT0, kT0 + microseconds(100));
  EXPECT_EQ(d.take, 0u);
  ASSERT_TRUE(d.wake_at.has_value());
  // Measured from the oldest request, not from now.
  EXPECT_EQ(*d.wake_at, kT0 + microseconds(500));
}

TEST(BatchPolicyTest, PartialBatchRunsOnceOldestIsDue) {
  const std::vector<int64_t> q = {4, 4, 1};
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0 + microseconds(500)).take, 3u);
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0 + microseconds(9999)).take, 3u);
}

TEST(BatchPolicyTest, FullByTokensRunsAtOnce) {
  const std::vector<int64_t> q = {32, 32};
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0).take, 2u);
}

TEST(BatchPolicyTest, TakesLongestPrefixThatFits) {
  // 30 + 30 fit in 64; the third would overflow, so the batch is full now.
  const std::vector<int64_t> q = {30, 30, 10, 1};
  const BatchDecision d = DecideBatch(Policy(64, 500), q, kT0, kT0);
  EXPECT_EQ(d.take, 2u);
  EXPECT_FALSE(d.wake_at.has_value());
}

TEST(BatchPolicyTest, NeverSkipsAheadOfALargeRequest) {
  // Arrival order is kept: the 60-token request waits for the next batch even
  // though the 1-token request behind it would fit.
  const std::vector<int64_t> q = {10, 60, 1};
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0).take, 1u);
}

TEST(BatchPolicyTest, SingleRequestAtTheLimitRunsAlone) {
  const std::vector<int64_t> q = {64, 1};
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0).take, 1u);
}

TEST(BatchPolicyTest, ZeroDelayRunsImmediately) {
  const std::vector<int64_t> q = {1};
  EXPECT_EQ(DecideBatch(Policy(64, 0), q, kT0, kT0).take, 1u);
}

TEST(BatchPolicyTest, BatchOfOneTokenPerRequestIsBoundedByTokens) {
  std::vector<int64_t> q(100, 1);
  EXPECT_EQ(DecideBatch(Policy(64, 500), q, kT0, kT0).take, 64u);
}

}  // namespace
}  // namespace layerserve
