// ThreadPool (base/thread_pool.h): every index runs exactly once, whatever the
// pool's size, job after job on the same pool; the calls run on n threads at
// once, the caller among them, the others named after the pool; what the
// calls wrote is visible to the caller when ParallelFor returns; an empty
// range calls nothing; pools start and stop cleanly, used or not.
#include "base/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "base/thread_name.h"

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

// Holds each caller until `count` callers are inside at once, or until a
// generous timeout (which fails the test rather than hanging it).
class Rendezvous {
 public:
  explicit Rendezvous(int count) : count_(count) {}
  // True once `count` callers have arrived; false on timeout.
  bool Arrive() {
    std::unique_lock<std::mutex> lock(mu_);
    ++arrived_;
    cv_.notify_all();
    return cv_.wait_for(lock, std::chrono::seconds(30), [&] { return arrived_ >= count_; });
  }

 private:
  const int count_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
};

// n calls that each wait for all n to be running can only finish if the pool
// runs them on n threads at once: each thread holds one index until all have
// theirs, so no thread can take two.
TEST(ThreadPoolTest, RunsOnAllItsThreadsAtOnceTheCallerIncluded) {
  constexpr int kThreads = 4;
  ThreadPool pool(kThreads, "tpool");
  Rendezvous rendezvous(kThreads);
  std::mutex mu;
  std::set<std::thread::id> ids;
  std::set<std::string> names;
  std::atomic<int> met{0};
  pool.ParallelFor(kThreads, [&](int64_t) {
    if (rendezvous.Arrive()) met++;
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
    names.insert(ThisThreadName());
  });
  EXPECT_EQ(met.load(), kThreads) << "the calls did not all run at once";
  EXPECT_EQ(ids.size(), static_cast<size_t>(kThreads));
  EXPECT_EQ(ids.count(std::this_thread::get_id()), 1u) << "the calling thread took no call";
  // The pool's own threads are named after it; the caller keeps its name.
  for (const std::string& expected : {"tpool-1", "tpool-2", "tpool-3"}) {
    EXPECT_EQ(names.count(expected), 1u) << "no call ran on a thread named " << expected;
  }
}

TEST(ThreadPoolTest, APoolOfOneRunsEverythingOnTheCaller) {
  ThreadPool pool(1);
  std::vector<std::thread::id> ids(50);
  pool.ParallelFor(50,
                   [&](int64_t i) { ids[static_cast<size_t>(i)] = std::this_thread::get_id(); });
  for (const std::thread::id& id : ids) EXPECT_EQ(id, std::this_thread::get_id());
}

// Plain (not atomic) writes of the calls are visible to the caller once
// ParallelFor returns, without further synchronization (the ThreadSanitizer
// build checks this).
TEST(ThreadPoolTest, WritesOfTheCallsAreVisibleAfterReturn) {
  ThreadPool pool(3);
  std::vector<int64_t> squares(10000, -1);
  for (int job = 0; job < 5; ++job) {
    pool.ParallelFor(static_cast<int64_t>(squares.size()),
                     [&](int64_t i) { squares[static_cast<size_t>(i)] = i * i + job; });
    for (size_t i = 0; i < squares.size(); ++i) {
      ASSERT_EQ(squares[i], static_cast<int64_t>(i * i) + job) << "job " << job << " index " << i;
    }
  }
}

TEST(ThreadPoolTest, AnEmptyRangeCallsNothing) {
  ThreadPool pool(4);
  std::atomic<int> calls{0};
  pool.ParallelFor(0, [&](int64_t) { calls++; });
  EXPECT_EQ(calls.load(), 0);
}

// Pools that never ran a job, and pools destroyed right after one, stop
// their threads and return from the destructor.
TEST(ThreadPoolTest, StartsAndStopsCleanly) {
  for (int round = 0; round < 20; ++round) {
    { ThreadPool idle(4); }
    ThreadPool used(4);
    std::atomic<int64_t> sum{0};
    used.ParallelFor(100, [&](int64_t i) { sum += i; });
    EXPECT_EQ(sum.load(), 4950);
  }
}

}  // namespace
}  // namespace layerserve
