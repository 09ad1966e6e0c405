// The limiter behind protobuf's log: a burst per window passes, the rest is
// counted and reported with the next line that passes.
#include "server/grpc/protobuf_log.h"

#include <gtest/gtest.h>

namespace layerserve {
namespace {

using std::chrono::seconds;

TEST(LogRateLimiterTest, BurstPerWindowThenCountsTheRest) {
  LogRateLimiter limiter(3, seconds(60));
  const LogRateLimiter::Time t0 = LogRateLimiter::Time() + seconds(1000);
  int64_t suppressed = -1;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(limiter.Allow(t0 + seconds(i), &suppressed));
    EXPECT_EQ(suppressed, 0);
  }
  for (int i = 0; i < 1000; ++i) EXPECT_FALSE(limiter.Allow(t0 + seconds(10), &suppressed));
  // A new window: the next line passes and reports the thousand it replaced.
  ASSERT_TRUE(limiter.Allow(t0 + seconds(60), &suppressed));
  EXPECT_EQ(suppressed, 1000);
  ASSERT_TRUE(limiter.Allow(t0 + seconds(61), &suppressed));
  EXPECT_EQ(suppressed, 0);
}

}  // namespace
}  // namespace layerserve
