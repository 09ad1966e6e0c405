// Transport deadlines move onto the steady clock without overflowing,
// however far away a client puts them.
#include "server/grpc/request_convert.h"

#include <gtest/gtest.h>

#include <chrono>

namespace layerserve {
namespace {

using std::chrono::hours;
using std::chrono::seconds;

const SteadyTime kSteadyNow = SteadyTime() + hours(1000);

gpr_timespec Realtime(int64_t sec, int32_t nsec = 0) {
  gpr_timespec t;
  t.tv_sec = sec;
  t.tv_nsec = nsec;
  t.clock_type = GPR_CLOCK_REALTIME;
  return t;
}

TEST(SteadyDeadlineTest, NoDeadlineAndPastDeadlines) {
  const gpr_timespec now = Realtime(1'700'000'000);
  EXPECT_EQ(SteadyDeadline(gpr_inf_future(GPR_CLOCK_REALTIME), now, kSteadyNow), std::nullopt);
  EXPECT_EQ(
      SteadyDeadline(gpr_inf_future(GPR_CLOCK_MONOTONIC), gpr_now(GPR_CLOCK_MONOTONIC), kSteadyNow),
      std::nullopt);
  EXPECT_EQ(SteadyDeadline(Realtime(1'699'999'999), now, kSteadyNow), kSteadyNow);
  EXPECT_EQ(SteadyDeadline(now, now, kSteadyNow), kSteadyNow);
}

TEST(SteadyDeadlineTest, NearDeadlinesKeepTheirDistance) {
  const gpr_timespec now = Realtime(1'700'000'000, 900'000'000);
  EXPECT_EQ(SteadyDeadline(Realtime(1'700'000'005, 100'000'000), now, kSteadyNow),
            kSteadyNow + std::chrono::milliseconds(4200));
}

// grpc-timeout 2562047H (2^63 ns, grpc-java's largest) and anything from
// ~239 years on lies past 2262, the end of a nanosecond system_clock: these
// saturate to a century instead of wrapping into the past.
TEST(SteadyDeadlineTest, FarFutureDeadlinesSaturate) {
  const gpr_timespec now = gpr_now(GPR_CLOCK_REALTIME);
  for (const int64_t far_hours : {int64_t{2562047}, int64_t{239} * 366 * 24, int64_t{99999999}}) {
    SCOPED_TRACE(far_hours);
    gpr_timespec deadline = now;
    deadline.tv_sec += far_hours * 3600;
    const std::optional<SteadyTime> steady = SteadyDeadline(deadline, now, kSteadyNow);
    ASSERT_TRUE(steady.has_value());
    EXPECT_GE(*steady - kSteadyNow, hours(24 * 365 * 99));
  }
}

}  // namespace
}  // namespace layerserve
