// StatsRecorder: the ModelStatistics counters perf_analyzer diffs.
#include "server/core/stats.h"

#include <gtest/gtest.h>

namespace layerserve {
namespace {

TEST(StatsRecorderTest, EachRequestOfABatchCountsTheBatchsSplitOfComputeTime) {
  StatsRecorder stats;
  stats.OnBatchExecuted({.requests = 3,
                         .tokens = 3,
                         .compute_seconds = 0.010,
                         .ok = true,
                         .input_seconds = 0.001,
                         .output_seconds = 0.002});
  const ModelStatsSnapshot s = stats.Snapshot();
  EXPECT_EQ(s.execution_count, 1u);
  EXPECT_EQ(s.inference_count, 3u);
  for (const DurationStat* d : {&s.compute_input, &s.compute_infer, &s.compute_output}) {
    EXPECT_EQ(d->count, 3u);
  }
  EXPECT_EQ(s.compute_input.ns, 3u * 1'000'000);
  EXPECT_EQ(s.compute_infer.ns, 3u * 7'000'000);  // what input and output leave
  EXPECT_EQ(s.compute_output.ns, 3u * 2'000'000);
  EXPECT_EQ(s.batch_compute_infer.at(3).count, 1u);
  EXPECT_EQ(s.batch_compute_infer.at(3).ns, 10'000'000u);
}

TEST(StatsRecorderTest, ABackendThatDoesNotSplitItsTimeReportsItAllAsInfer) {
  StatsRecorder stats;
  stats.OnBatchExecuted({.requests = 2, .tokens = 2, .compute_seconds = 0.004, .ok = true});
  const ModelStatsSnapshot s = stats.Snapshot();
  EXPECT_EQ(s.compute_input.ns, 0u);
  EXPECT_EQ(s.compute_infer.ns, 2u * 4'000'000);
  EXPECT_EQ(s.compute_output.ns, 0u);
}

TEST(StatsRecorderTest, FailedBatchesAreNotCounted) {
  StatsRecorder stats;
  stats.OnBatchExecuted({.requests = 2, .tokens = 2, .compute_seconds = 0.004, .ok = false});
  EXPECT_EQ(stats.Snapshot().execution_count, 0u);
  EXPECT_EQ(stats.Snapshot().compute_infer.count, 0u);
}

}  // namespace
}  // namespace layerserve
