// The dynamic batcher's scheduling loop (see batcher.h).
//
// One thread decides; it sleeps on a condition variable until something can
// change its decision: a new request, a finished batch, the oldest request's
// batching deadline, the earliest request deadline, or shutdown.
#include "server/core/batcher.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace layerserve {
namespace {

double Seconds(SteadyTime::duration d) { return std::chrono::duration<double>(d).count(); }

int64_t InputBytes(const InferRequest& r) { return static_cast<int64_t>(r.input.size()); }

}  // namespace

int64_t DefaultMaxQueueBytes(const BatchPolicy& policy, int64_t hidden) {
  int64_t bytes = 0;
  if (__builtin_mul_overflow(policy.max_batch_tokens, hidden, &bytes) ||
      __builtin_mul_overflow(bytes, int64_t{4} * kDefaultQueuedBatches, &bytes)) {
    return INT64_MAX;
  }
  return bytes;
}

Batcher::Batcher(BatcherOptions options, Backend* backend, ServerObserver* observer,
                 const Clock* clock)
    : options_(options), backend_(backend), observer_(observer), clock_(clock) {
  for (int i = 0; i < std::max(1, options_.reply_threads); ++i) {
    reply_threads_.emplace_back([this] { RunReplies(); });
  }
  thread_ = std::thread([this] { Run(); });
}

Batcher::~Batcher() { Shutdown(); }

absl::Status Batcher::Enqueue(std::unique_ptr<InferRequest>& request) {
  MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (static_cast<int64_t>(queue_.size()) >= options_.max_queue_size) {
    return absl::ResourceExhaustedError(absl::StrCat("request queue is full (", queue_.size(),
                                                     " requests waiting, --max-queue-size)"));
  }
  // Every request of one server has the model's hidden size, so the default
  // is the same for all of them.
  const int64_t max_bytes = options_.max_queue_bytes > 0
                                ? options_.max_queue_bytes
                                : DefaultMaxQueueBytes(options_.policy, request->hidden);
  const int64_t bytes = InputBytes(*request);
  if (!queue_.empty() && bytes > max_bytes - queued_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request queue is full (", queued_bytes_, " bytes queued in ", queue_.size(),
                     " requests; this request's ", bytes, " bytes would pass the queue's limit of ",
                     max_bytes, " bytes)"));
  }
  request->enqueue_time = clock_->Now();
  queued_bytes_ += bytes;
  queue_.push_back(std::move(request));
  observer_->OnQueueDepth(static_cast<int64_t>(queue_.size()));
  cv_.Signal();
  return absl::OkStatus();
}

void Batcher::Wake() {
  MutexLock lock(&mu_);
  wake_ = true;
  cv_.Signal();
}

void Batcher::Shutdown() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    cv_.Signal();
  }
  if (thread_.joinable()) thread_.join();
  // The scheduler has seen every batch finish, and a batch queues its
  // replies before it counts as finished: the repliers drain, then stop.
  {
    MutexLock lock(&reply_mu_);
    replies_stopping_ = true;
    reply_cv_.SignalAll();
  }
  for (std::thread& t : reply_threads_) {
    if (t.joinable()) t.join();
  }
}

int64_t Batcher::queue_depth() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size());
}

void Batcher::DropDeadLocked(SteadyTime now, std::vector<std::unique_ptr<InferRequest>>& dropped) {
  const size_t before = queue_.size();
  for (auto it = queue_.begin(); it != queue_.end();) {
    InferRequest& r = **it;
    const bool expired = r.deadline && *r.deadline <= now;
    if (expired || (r.is_cancelled && r.is_cancelled())) {
      queued_bytes_ -= InputBytes(r);
      dropped.push_back(std::move(*it));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  if (queue_.size() != before) observer_->OnQueueDepth(static_cast<int64_t>(queue_.size()));
}

void Batcher::Run() {
  const int max_inflight = std::max(1, backend_->MaxInflightBatches());
  std::vector<int64_t> tokens;
  for (;;) {
    std::vector<std::unique_ptr<InferRequest>> dropped;
    std::shared_ptr<Batch> batch;
    SteadyTime now;
    {
      MutexLock lock(&mu_);
      now = clock_->Now();
      DropDeadLocked(now, dropped);
      if (stopping_ && queue_.empty() && inflight_batches_ == 0 && dropped.empty()) return;

      std::optional<SteadyTime> wake_at;
      if (!queue_.empty() && inflight_batches_ < max_inflight) {
        tokens.clear();
        for (const auto& r : queue_) tokens.push_back(r->tokens());
        BatchDecision decision =
            DecideBatch(options_.policy, tokens, queue_.front()->enqueue_time, now);
        // Draining: run what is queued without waiting for more to arrive.
        if (decision.take == 0 && stopping_)
          decision =
              DecideBatch(options_.policy, tokens, now - options_.policy.max_queue_delay, now);
        if (decision.take > 0) {
          batch = std::make_shared<Batch>();
          for (size_t i = 0; i < decision.take; ++i) {
            queued_bytes_ -= InputBytes(*queue_.front());
            batch->requests.push_back(std::move(queue_.front()));
            queue_.pop_front();
          }
          ++inflight_batches_;
          observer_->OnQueueDepth(static_cast<int64_t>(queue_.size()));
        } else {
          wake_at = decision.wake_at;
        }
      }
      if (!batch && dropped.empty()) {
        // Also wake for the earliest request deadline, so expired requests
        // are answered even while the backend is busy.
        for (const auto& r : queue_) {
          if (r->deadline && (!wake_at || *r->deadline < *wake_at)) wake_at = r->deadline;
        }
        if (!wake_) {
          if (wake_at) {
            const auto wait = std::max(*wake_at - now, SteadyTime::duration::zero());
            cv_.WaitFor(&mu_, wait);
          } else {
            cv_.Wait(&mu_);
          }
        }
        wake_ = false;
        continue;
      }
    }

    // Outside the lock: answer dropped requests, start the batch.
    for (auto& r : dropped) {
      const bool expired = r->deadline && *r->deadline <= now;
      r->queue_seconds = Seconds(now - r->enqueue_time);
      observer_->OnDequeued({r->queue_seconds});
      r->on_done(expired ? absl::DeadlineExceededError("deadline exceeded while queued")
                         : absl::CancelledError("request cancelled while queued"));
    }
    if (batch) {
      for (auto& r : batch->requests) {
        r->queue_seconds = Seconds(now - r->enqueue_time);
        r->batch_requests = static_cast<int64_t>(batch->requests.size());
        observer_->OnDequeued({r->queue_seconds});
      }
      batch->Pack();
      const SteadyTime start = clock_->Now();
      backend_->Execute(batch, [this, batch, start](absl::Status status) {
        OnBatchDone(batch, start, std::move(status));
      });
    }
  }
}

void Batcher::OnBatchDone(const std::shared_ptr<Batch>& batch, SteadyTime start,
                          absl::Status status) {
  const double compute_seconds = Seconds(clock_->Now() - start);
  // Recorded before the replies, so statistics read after a reply include it.
  observer_->OnBatchExecuted({static_cast<int64_t>(batch->requests.size()), batch->total_tokens,
                              compute_seconds, status.ok()});
  for (auto& r : batch->requests) r->compute_seconds = compute_seconds;
  {
    MutexLock lock(&reply_mu_);
    for (size_t i = 0; i < batch->requests.size(); ++i) replies_.push_back({batch, i, status});
    reply_cv_.SignalAll();
  }
  // The slot is free as soon as the results are on the host; the next batch
  // need not wait for this one's replies.
  MutexLock lock(&mu_);
  --inflight_batches_;
  cv_.Signal();
}

void Batcher::RunReplies() {
  for (;;) {
    Reply reply;
    {
      MutexLock lock(&reply_mu_);
      while (replies_.empty() && !replies_stopping_) reply_cv_.Wait(&reply_mu_);
      if (replies_.empty()) return;  // stopping, and nothing left to answer
      reply = std::move(replies_.front());
      replies_.pop_front();
    }
    reply.batch->requests[reply.index]->on_done(std::move(reply.status));
  }
}

}  // namespace layerserve
