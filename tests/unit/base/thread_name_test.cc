// NameThisThread: a thread reads back the name it gave itself, a name past
// the kernel's 15 bytes is cut there, and a pool's threads carry its name.
#include "base/thread_name.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <thread>

#include "base/mutex.h"
#include "base/thread_pool.h"

namespace layerserve {
namespace {

std::string NameOnNewThread(const std::string& name) {
  std::string seen;
  std::thread([&] {
    NameThisThread(name);
    seen = ThisThreadName();
  }).join();
  return seen;
}

TEST(ThreadNameTest, AThreadReadsBackItsName) { EXPECT_EQ(NameOnNewThread("reply-3"), "reply-3"); }

TEST(ThreadNameTest, LongNamesAreCutAtFifteenBytes) {
  EXPECT_EQ(NameOnNewThread("a-name-of-twenty-bytes"), "a-name-of-twent");
}

TEST(ThreadNameTest, PoolThreadsCarryThePoolsName) {
  ThreadPool pool(3, "copy0");
  Mutex mu;
  std::set<std::string> names;
  // Enough items that both workers take some; the caller's own name is left
  // out (it is the test's thread).
  const std::string caller = ThisThreadName();
  for (int attempt = 0; attempt < 100 && names.size() < 2; ++attempt) {
    pool.ParallelFor(64, [&](int64_t) {
      std::string name = ThisThreadName();
      std::this_thread::yield();
      MutexLock lock(&mu);
      if (name != caller) names.insert(std::move(name));
    });
  }
  EXPECT_EQ(names, (std::set<std::string>{"copy0-1", "copy0-2"}));
}

}  // namespace
}  // namespace layerserve
