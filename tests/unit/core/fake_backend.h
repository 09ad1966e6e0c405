// Test doubles for the batcher's tests: a backend whose completions run on
// their own thread (as the real backends' do), a one-shot event and a
// request that records its outcome.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "base/mutex.h"
#include "server/core/batcher.h"

namespace layerserve {

// Writes output = input with every byte incremented, on a worker thread. Can
// be held closed so tests control when batches finish.
class FakeBackend final : public Backend {
 public:
  explicit FakeBackend(int slots) : slots_(slots), worker_([this] { Work(); }) {}
  ~FakeBackend() override {
    {
      MutexLock lock(&mu_);
      stop_ = true;
      open_ = true;
      cv_.SignalAll();
    }
    worker_.join();
  }
  std::string_view Name() const override { return "fake"; }
  int MaxInflightBatches() const override { return slots_; }
  void Execute(std::shared_ptr<Batch> batch, std::function<void(absl::Status)> done) override {
    MutexLock lock(&mu_);
    batch_sizes_.push_back(batch->requests.size());
    batch_tokens_.push_back(batch->total_tokens);
    std::vector<std::pair<std::string, int64_t>> steps;
    for (const auto& r : batch->requests) {
      steps.emplace_back(r->id, r->session ? r->step.position : -1);
    }
    batch_steps_.push_back(std::move(steps));
    pending_.push_back({std::move(batch), std::move(done)});
    cv_.SignalAll();
  }
  void SetOpen(bool open) {
    MutexLock lock(&mu_);
    open_ = open;
    cv_.SignalAll();
  }
  std::vector<size_t> batch_sizes() const {
    MutexLock lock(&mu_);
    return batch_sizes_;
  }
  std::vector<int64_t> batch_tokens() const {
    MutexLock lock(&mu_);
    return batch_tokens_;
  }
  // Per batch: each request's id and its session step's position (-1 for a
  // stateless request), in batch order.
  std::vector<std::vector<std::pair<std::string, int64_t>>> batch_steps() const {
    MutexLock lock(&mu_);
    return batch_steps_;
  }
  // Makes every following batch fail with `status` (OK: succeed again).
  void SetFailure(absl::Status status) {
    MutexLock lock(&mu_);
    failure_ = std::move(status);
  }
  // Makes the batches from the `index`th run on (0-based) fail with `status`.
  void SetFailureFrom(size_t index, absl::Status status) {
    MutexLock lock(&mu_);
    fail_from_ = index;
    failure_ = std::move(status);
  }
  // Blocks until `n` batches have been submitted (or 10 s pass).
  bool AwaitBatches(size_t n) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    MutexLock lock(&mu_);
    while (batch_sizes_.size() < n) {
      if (std::chrono::steady_clock::now() > give_up) return false;
      cv_.WaitFor(&mu_, std::chrono::milliseconds(50));
    }
    return true;
  }

 private:
  struct Item {
    std::shared_ptr<Batch> batch;
    std::function<void(absl::Status)> done;
  };
  void Work() {
    for (;;) {
      Item item;
      absl::Status failure;
      {
        MutexLock lock(&mu_);
        while (!stop_ && !(open_ && !pending_.empty())) cv_.Wait(&mu_);
        if (pending_.empty()) return;
        item = std::move(pending_.front());
        pending_.pop_front();
        if (ran_++ >= fail_from_) failure = failure_;
      }
      if (!failure.ok()) {
        item.done(failure);
        continue;
      }
      for (auto& r : item.batch->requests) {
        r->output.assign(r->input);
        for (char& c : r->output) c = static_cast<char>(c + 1);
      }
      item.done(absl::OkStatus());
    }
  }

  const int slots_;
  mutable Mutex mu_;
  CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
  std::deque<Item> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> batch_sizes_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> batch_tokens_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<std::pair<std::string, int64_t>>> batch_steps_ ABSL_GUARDED_BY(mu_);
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  size_t fail_from_ ABSL_GUARDED_BY(mu_) = 0;
  size_t ran_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread worker_;
};

// A one-shot event (absl::Notification is invisible to TSAN here; see mutex.h).
class Notification {
 public:
  void Notify() {
    MutexLock lock(&mu_);
    notified_ = true;
    cv_.SignalAll();
  }
  bool HasBeenNotified() {
    MutexLock lock(&mu_);
    return notified_;
  }
  bool WaitFor(std::chrono::milliseconds timeout) {
    const auto give_up = std::chrono::steady_clock::now() + timeout;
    MutexLock lock(&mu_);
    while (!notified_) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= give_up) return false;
      cv_.WaitFor(&mu_, give_up - now);
    }
    return true;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  bool notified_ ABSL_GUARDED_BY(mu_) = false;
};

// Each request's final status and output, written once by on_done.
struct Outcome {
  Notification done;
  absl::Status status;
  std::string output;
};

inline std::unique_ptr<InferRequest> MakeRequest(const std::string& payload, int64_t tokens,
                                                 Outcome* out) {
  auto r = std::make_unique<InferRequest>();
  r->dtype = DType::kBF16;
  r->batch = 1;
  r->seq_len = tokens;
  r->hidden = 1;
  r->input = payload;
  InferRequest* raw = r.get();
  r->on_done = [out, raw](absl::Status s) {
    out->status = s;
    out->output = raw->output;
    out->done.Notify();
  };
  return r;
}

// Makes the device busy: closes `backend` and runs one 1-token stateless
// request (id "plug", answered into `out`) through `batcher`, which stays in
// flight, holding one of the backend's slots, until SetOpen(true). An idle
// device runs a request as soon as it is queued; while a batch is in flight,
// what is queued after it waits for the batching delay (or a full batch) and
// a free slot, which is what tests of batch formation need.
inline void KeepBusy(Batcher& batcher, FakeBackend& backend, Outcome* out) {
  static const std::string kPayload = "p";
  backend.SetOpen(false);
  const size_t before = backend.batch_sizes().size();
  auto plug = MakeRequest(kPayload, 1, out);
  plug->id = "plug";
  ASSERT_TRUE(batcher.Enqueue(plug).ok());
  ASSERT_TRUE(backend.AwaitBatches(before + 1));
}

// Just-in-time formation off: under a FakeClock that is not advanced every
// batch computes in no time, so its prediction would always be "overdue" and
// the next batch would never wait for the delay. Tests of just-in-time
// formation turn it on themselves.
inline BatcherOptions Options(int64_t max_tokens, int64_t delay_us, int64_t queue = 1024) {
  BatchPolicy policy{max_tokens, std::chrono::microseconds(delay_us)};
  policy.max_device_wait = std::chrono::microseconds(0);
  return BatcherOptions{policy, queue};
}

}  // namespace layerserve
