// The memory trimmer: a burst of heap blocks, freed between blocks that
// stay, remains resident under glibc until the trimmer notices the growth
// and trims; growth under the threshold is left alone.
#include "base/memory_trimmer.h"

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

// Allocates and touches `bytes` in 64 KiB blocks (under glibc's mmap
// threshold, so from the heap), each followed by a 16-byte block that stays;
// frees the large ones. The holes between the small blocks cannot be given
// back by shrinking the heap's top, so they stay resident until a trim.
// Returns the small blocks, for the caller to free.
std::vector<void*> BurstAndFree(int64_t bytes) {
  std::vector<void*> large, small;
  for (int64_t done = 0; done < bytes; done += 64 * 1024) {
    void* p = std::malloc(64 * 1024);
    std::memset(p, 1, 64 * 1024);
    large.push_back(p);
    small.push_back(std::malloc(16));
  }
  for (void* p : large) std::free(p);
  return small;
}

void FreeAll(const std::vector<void*>& blocks) {
  for (void* p : blocks) std::free(p);
}

bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

TEST(MemoryTrimmerTest, ReadsTheResidentSet) {
  const int64_t rss = ResidentBytes();
  EXPECT_GT(rss, 1 * kMiB);
  EXPECT_LT(rss, int64_t{1} << 40);
}

TEST(MemoryTrimmerTest, GivesABurstBackAfterItGrewPastTheThreshold) {
  MemoryTrimmer trimmer(std::chrono::milliseconds(20), 64 * kMiB);
  const int64_t before = ResidentBytes();
  const std::vector<void*> kept = BurstAndFree(256 * kMiB);
  const int64_t peak = ResidentBytes();
  ASSERT_GT(peak - before, 128 * kMiB) << "the burst was not resident";
  EXPECT_TRUE(WaitFor([&] { return trimmer.trims() >= 1; }, std::chrono::seconds(5)));
  if (!kSanitizerAllocator) {
    EXPECT_TRUE(
        WaitFor([&] { return ResidentBytes() - before < 64 * kMiB; }, std::chrono::seconds(5)))
        << "RSS " << ResidentBytes() / kMiB << " MiB, " << before / kMiB << " before the burst, "
        << peak / kMiB << " at its peak";
  }
  FreeAll(kept);
}

TEST(MemoryTrimmerTest, LeavesGrowthUnderTheThresholdAlone) {
  MemoryTrimmer trimmer(std::chrono::milliseconds(10), int64_t{1} << 40);
  const std::vector<void*> kept = BurstAndFree(32 * kMiB);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(trimmer.trims(), 0);
  FreeAll(kept);
}

}  // namespace
}  // namespace layerserve
