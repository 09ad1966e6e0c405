// The memory trimmer (see memory_trimmer.h).
#include "server/memory_trimmer.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "base/log.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace layerserve {

int64_t ResidentBytes() {
  std::FILE* statm = std::fopen("/proc/self/statm", "r");
  if (statm == nullptr) return -1;
  long long size_pages = 0, resident_pages = 0;
  const int read = std::fscanf(statm, "%lld %lld", &size_pages, &resident_pages);
  std::fclose(statm);
  if (read != 2) return -1;
  return static_cast<int64_t>(resident_pages) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

int64_t FreeHeapBytes() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  // Summed over every arena; free chunks stay counted after a trim gave their
  // pages back.
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.fordblks + info.fsmblks);
#else
  return -1;
#endif
}

MemoryTrimmer::MemoryTrimmer(std::chrono::milliseconds period, int64_t growth_bytes)
    : period_(period), growth_bytes_(growth_bytes), thread_([this] { Loop(); }) {}

MemoryTrimmer::~MemoryTrimmer() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  stop_cv_.SignalAll();
  thread_.join();
}

int64_t MemoryTrimmer::trims() const {
  MutexLock lock(&mu_);
  return trims_;
}

void MemoryTrimmer::Loop() {
  // After the last trim (or at start): the resident set, and the bytes the
  // heap held free. Growth of either since then makes the next trim.
  int64_t rss_after = ResidentBytes();
  int64_t free_after = FreeHeapBytes();
  // The free bytes as last seen, and since when they have not changed.
  int64_t free_seen = free_after;
  auto free_since = std::chrono::steady_clock::now();
  while (true) {
    {
      MutexLock lock(&mu_);
      // Spurious wake-ups only shorten one period.
      if (!stop_) stop_cv_.WaitFor(&mu_, period_);
      if (stop_) return;
    }
    const int64_t rss = ResidentBytes();
    const int64_t heap_free = FreeHeapBytes();
    // Shrinking on its own (or reuse of free memory) lowers the references.
    if (rss >= 0 && rss < rss_after) rss_after = rss;
    if (heap_free >= 0 && heap_free < free_after) free_after = heap_free;
    // `grew`: the process took memory (a trim then finds what it has freed
    // of it so far); `freed`: live memory was freed since, even where the
    // RSS did not grow after the last trim (one during a burst, say).
    const bool grew = rss >= 0 && rss_after >= 0 && rss - rss_after >= growth_bytes_;
    const bool freed = heap_free >= 0 && free_after >= 0 && heap_free - free_after >= growth_bytes_;
    // `settled`: memory was freed since the last trim, less than
    // growth_bytes, and the heap has been still for a second. A trim in the
    // middle of a release (a burst freed block by block) gives back only
    // what was free by then; the rest, under the threshold, would stay
    // resident until the next burst.
    // (Still: within a 64th of growth_bytes, so that the small allocations
    // of a quiet process do not count as motion.)
    const auto now = std::chrono::steady_clock::now();
    if (std::abs(heap_free - free_seen) >= growth_bytes_ / 64) {
      free_seen = heap_free;
      free_since = now;
    }
    const bool settled = heap_free >= 0 && free_after >= 0 &&
                         heap_free - free_after >= growth_bytes_ / 8 &&
                         now - free_since >= std::chrono::seconds(1);
    if (!grew && !freed && !settled) continue;
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
    rss_after = ResidentBytes();
    // The free bytes as read before the trim, not after it: what another
    // thread frees while the trim holds the heap's lock is freed once the
    // trim has passed, and must count as freed since it.
    free_after = heap_free >= 0 ? heap_free : FreeHeapBytes();
    // A line only for a real give-back: trims that find little stay quiet.
    if (rss >= 0 && rss_after >= 0 && rss - rss_after >= growth_bytes_) {
      LogInfo(absl::StrCat("memory: gave ", (rss - rss_after) >> 20,
                           " MiB of freed heap back to the system (resident ", rss >> 20, " -> ",
                           rss_after >> 20, " MiB)"));
    }
    MutexLock lock(&mu_);
    ++trims_;
  }
}

}  // namespace layerserve
