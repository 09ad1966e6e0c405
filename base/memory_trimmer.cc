// The memory trimmer (see memory_trimmer.h).
#include "base/memory_trimmer.h"

#include <unistd.h>

#include <cstdio>

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
  int64_t reference = ResidentBytes();
  while (true) {
    {
      MutexLock lock(&mu_);
      // Spurious wake-ups only shorten one period.
      if (!stop_) stop_cv_.WaitFor(&mu_, period_);
      if (stop_) return;
    }
    const int64_t rss = ResidentBytes();
    if (rss < 0 || reference < 0 || rss - reference < growth_bytes_) {
      // Shrinking on its own lowers the reference too.
      if (rss >= 0 && (reference < 0 || rss < reference)) reference = rss;
      continue;
    }
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
    reference = ResidentBytes();
    MutexLock lock(&mu_);
    ++trims_;
  }
}

}  // namespace layerserve
