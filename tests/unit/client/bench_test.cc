// Tests of the bench's statistics (client/bench.h): nearest-rank percentiles
// and the option checks that run before any request is sent.
#include "client/bench.h"

#include <gtest/gtest.h>

namespace layerserve::client {
namespace {

TEST(PercentileTest, NearestRank) {
  std::vector<double> samples;
  for (int i = 100; i >= 1; --i) samples.push_back(i);  // unsorted on purpose
  EXPECT_EQ(Percentile(samples, 50), 50);
  EXPECT_EQ(Percentile(samples, 90), 90);
  EXPECT_EQ(Percentile(samples, 99), 99);
  EXPECT_EQ(Percentile(samples, 100), 100);
  EXPECT_EQ(Percentile(samples, 0), 1);
  EXPECT_EQ(Percentile({7.0}, 99), 7);
  EXPECT_EQ(Percentile({}, 50), 0);
  EXPECT_EQ(Percentile({1.0, 2.0, 3.0}, 50), 2);
  EXPECT_EQ(Percentile({1.0, 2.0, 3.0, 4.0}, 50), 2);
}

TEST(BenchOptionsTest, InconsistentOptionsFailBeforeConnecting) {
  // The address is never dialled: every case fails in the option checks.
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect("127.0.0.1:1");
  ASSERT_TRUE(client.ok());
  BenchOptions base;
  base.model = "demo";
  base.hidden = 8;
  base.concurrency = 1;
  base.progress = false;

  BenchOptions both = base;
  both.rate_per_second = 10;
  BenchOptions neither = base;
  neither.concurrency = 0;
  BenchOptions no_model = base;
  no_model.model.clear();
  BenchOptions bad_datatype = base;
  bad_datatype.datatype = "INT8";
  BenchOptions zero_tokens = base;
  zero_tokens.tokens = 0;
  BenchOptions zero_duration = base;
  zero_duration.duration_seconds = 0;
  for (const BenchOptions& options :
       {both, neither, no_model, bad_datatype, zero_tokens, zero_duration}) {
    EXPECT_EQ(RunBench(**client, options).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace layerserve::client
