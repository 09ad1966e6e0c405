// The memory trimmer: a burst of heap blocks, freed between blocks that
// stay, remains resident under glibc until the trimmer notices and trims,
// also when it first saw the burst while it was live; growth under the
// threshold is left alone.
#include "server/memory_trimmer.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

namespace layerserve {
namespace {

// Sanitizers bring their own allocator: nothing of glibc's heap to give back.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define LS_TEST_SANITIZER_ALLOCATOR 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define LS_TEST_SANITIZER_ALLOCATOR 1
#endif
#endif
#ifdef LS_TEST_SANITIZER_ALLOCATOR
constexpr bool kSanitizerAllocator = true;
#else
constexpr bool kSanitizerAllocator = false;
#endif

constexpr int64_t kMiB = int64_t{1} << 20;

// `bytes` in 64 KiB blocks (under glibc's mmap threshold, so from the heap),
// touched, each followed by a 16-byte block. Freeing the large ones leaves
// holes between the small ones that shrinking the heap's top cannot give
// back: they stay resident until a trim.
struct Burst {
  std::vector<void*> large, small;
  explicit Burst(int64_t bytes) {
    for (int64_t done = 0; done < bytes; done += 64 * 1024) {
      void* p = std::malloc(64 * 1024);
      std::memset(p, 1, 64 * 1024);
      large.push_back(p);
      small.push_back(std::malloc(16));
    }
  }
  void FreeLarge() {
    for (void* p : large) std::free(p);
    large.clear();
  }
  ~Burst() {
    FreeLarge();
    for (void* p : small) std::free(p);
  }
};

bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

TEST(MemoryTrimmerTest, ReadsTheResidentSetAndTheFreeHeap) {
  const int64_t rss = ResidentBytes();
  EXPECT_GT(rss, 1 * kMiB);
  EXPECT_LT(rss, int64_t{1} << 40);
  if (!kSanitizerAllocator) {
    const int64_t free_before = FreeHeapBytes();
    ASSERT_GE(free_before, 0);
    Burst burst(64 * kMiB);
    burst.FreeLarge();
    EXPECT_GE(FreeHeapBytes() - free_before, 60 * kMiB);
  }
}

// The burst is live when the trimmer first sees the growth (its trim finds
// nothing to give back and the RSS reference rises to the burst's height);
// freeing it must still be noticed, by the heap's free bytes. The waits are
// long (a loaded 2-core machine may run the trimmer's 20 ms loop late, or trim
// while the burst is half freed, leaving the rest to its next turn): each is
// a bound on a condition that holds once the trimmer has run, not a timing.
constexpr auto kTrimmerTurn = std::chrono::seconds(30);
TEST(MemoryTrimmerTest, GivesABurstBackAfterItWasFreed) {
  MemoryTrimmer trimmer(std::chrono::milliseconds(20), 64 * kMiB);
  const int64_t before = ResidentBytes();
  Burst burst(256 * kMiB);
  const int64_t peak = ResidentBytes();
  ASSERT_GT(peak - before, 128 * kMiB) << "the burst was not resident";
  ASSERT_TRUE(WaitFor([&] { return trimmer.trims() >= 1; }, kTrimmerTurn));
  const int64_t trims_while_live = trimmer.trims();
  burst.FreeLarge();
  if (!kSanitizerAllocator) {
    EXPECT_TRUE(WaitFor([&] { return ResidentBytes() - before < 64 * kMiB; }, kTrimmerTurn))
        << "RSS " << ResidentBytes() / kMiB << " MiB, " << before / kMiB << " before the burst, "
        << peak / kMiB << " at its peak; heap free " << FreeHeapBytes() / kMiB << " MiB, "
        << trimmer.trims() << " trims";
    // (The RSS can fall while that trim runs, before it is counted.)
    EXPECT_TRUE(WaitFor([&] { return trimmer.trims() > trims_while_live; }, kTrimmerTurn));
  }
}

TEST(MemoryTrimmerTest, LeavesGrowthUnderTheThresholdAlone) {
  MemoryTrimmer trimmer(std::chrono::milliseconds(10), int64_t{1} << 40);
  Burst burst(32 * kMiB);
  burst.FreeLarge();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(trimmer.trims(), 0);
}

}  // namespace
}  // namespace layerserve
