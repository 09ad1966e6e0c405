// A fixed set of threads that run the calls of an index range in parallel,
// the calling thread with them. The CPU backend splits its operators over one;
// the CUDA backend gives each stream one for the batch's host copies.
#pragma once

#include <atomic>
#include <cstdint>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "base/mutex.h"

namespace layerserve {

// The calling thread takes part, so ThreadPool(n) starts n - 1 threads and ThreadPool(1) runs
// everything inline. The threads are named `name`-1, `name`-2, ... (thread_name.h). ParallelFor is
// not reentrant: one caller at a time (one per backend worker thread).
class ThreadPool {
 public:
  explicit ThreadPool(int num_threads, std::string_view name = "pool");
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  int num_threads() const { return static_cast<int>(threads_.size()) + 1; }

  // Calls fn(i) once for every i in [0, n), spread over the pool; returns when
  // all calls have returned.
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn);

 private:
  void WorkerLoop();
  // Claims and runs indices of the current job until none are left.
  void RunItems(absl::FunctionRef<void(int64_t)> fn, int64_t n);

  Mutex mu_;         // base/mutex.h: visible to the ThreadSanitizer build
  CondVar work_cv_;  // a new job, or stop_
  CondVar done_cv_;  // busy_workers_ reached 0
  const absl::FunctionRef<void(int64_t)>* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t job_size_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_workers_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int64_t> next_index_{0};
  std::vector<std::thread> threads_;
};

}  // namespace layerserve
