// Gives the heap memory a burst freed back to the kernel.
//
// glibc's malloc keeps freed memory for reuse and returns little of it on its
// own. After a flood of HTTP/2 streams that a client opens and resets at once
// (the CVE-2023-44487 pattern, issue 13) the server's RSS stayed at 6 GB, and
// one malloc_trim brought it to 0.23 GB: gRPC 1.51 had held ~10 KB of call
// arena per stream until its executor caught up, then freed it all. malloc_trim(0) returns every
// free page; calling it costs a walk of the heap's free chunks under each
// arena's lock, so it is done only after the resident set grew.
//
// A MemoryTrimmer owns a thread that every `period` reads the process's RSS
// and the bytes glibc's heap holds free, and calls malloc_trim(0) once either
// exceeds its value after the previous trim (or at start) by `growth_bytes`.
// Both matter: a trim in the middle of a burst finds little free and sets the
// RSS reference at the burst's height, so it is the free bytes that grow when
// the burst is released. And once the heap has been still for a second with
// an eighth of `growth_bytes` freed since the last trim, it trims once more:
// a trim in the middle of a release leaves the rest of it, under the
// threshold, resident otherwise. Where malloc_trim does not exist (not
// glibc), it does nothing.
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "base/mutex.h"

namespace layerserve {

// This process's resident set in bytes (/proc/self/statm), or -1 where it
// cannot be read.
int64_t ResidentBytes();
// Bytes glibc's heap holds in free chunks (all arenas), or -1 where unknown.
int64_t FreeHeapBytes();

class MemoryTrimmer {
 public:
  MemoryTrimmer(std::chrono::milliseconds period, int64_t growth_bytes);
  // Stops the thread (at once, not after a period).
  ~MemoryTrimmer();
  MemoryTrimmer(const MemoryTrimmer&) = delete;
  MemoryTrimmer& operator=(const MemoryTrimmer&) = delete;

  // Trims made so far (for tests and logs).
  int64_t trims() const;

 private:
  void Loop();

  const std::chrono::milliseconds period_;
  const int64_t growth_bytes_;
  mutable Mutex mu_;
  CondVar stop_cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t trims_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;  // last: started once everything above exists
};

}  // namespace layerserve
