// ThreadPool: every index runs exactly once, whatever the pool's size, job
// after job on the same pool.
#include "base/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace layerserve {
namespace {

TEST(ThreadPoolTest, RunsEveryIndexOnce) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {0, 1, 7, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      for (int repeat = 0; repeat < 3; ++repeat) {
        pool.ParallelFor(n, [&](int64_t i) { hits[static_cast<size_t>(i)]++; });
      }
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 3) << "threads " << threads << " n " << n;
      }
    }
  }
}

}  // namespace
}  // namespace layerserve
