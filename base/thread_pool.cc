// ThreadPool (see thread_pool.h): workers wait for a new job generation, then
// claim indices from a shared atomic counter with the caller; the last one to
// finish wakes the caller.
#include "base/thread_pool.h"

#include <string>

#include "base/thread_name.h"

namespace layerserve {

ThreadPool::ThreadPool(int num_threads, std::string_view name) {
  for (int i = 1; i < num_threads; ++i) {
    threads_.emplace_back([this, thread_name = std::string(name) + "-" + std::to_string(i)] {
      NameThisThread(thread_name);
      WorkerLoop();
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    work_cv_.SignalAll();
  }
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::RunItems(absl::FunctionRef<void(int64_t)> fn, int64_t n) {
  for (int64_t i = next_index_.fetch_add(1, std::memory_order_relaxed); i < n;
       i = next_index_.fetch_add(1, std::memory_order_relaxed)) {
    fn(i);
  }
}

void ThreadPool::ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) {
  if (threads_.empty() || n <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    MutexLock lock(&mu_);
    job_ = &fn;
    job_size_ = n;
    next_index_.store(0, std::memory_order_relaxed);
    busy_workers_ = static_cast<int>(threads_.size());
    ++generation_;
    work_cv_.SignalAll();
  }
  RunItems(fn, n);
  // `fn` lives in this frame, so wait until every worker has let go of it.
  MutexLock lock(&mu_);
  while (busy_workers_ > 0) done_cv_.Wait(&mu_);
  job_ = nullptr;
}

void ThreadPool::WorkerLoop() {
  uint64_t seen_generation = 0;
  while (true) {
    const absl::FunctionRef<void(int64_t)>* job;
    int64_t n;
    {
      MutexLock lock(&mu_);
      while (!stop_ && generation_ == seen_generation) work_cv_.Wait(&mu_);
      if (stop_) return;
      seen_generation = generation_;
      job = job_;
      n = job_size_;
    }
    RunItems(*job, n);
    MutexLock lock(&mu_);
    if (--busy_workers_ == 0) done_cv_.Signal();
  }
}

}  // namespace layerserve
