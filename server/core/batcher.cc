// The dynamic batcher's scheduling loop (see batcher.h).
//
// One thread decides; it sleeps on a condition variable until something can
// change its decision: a new request, a finished batch, the oldest request's
// batching deadline, the earliest request deadline, or shutdown.
#include "server/core/batcher.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "base/saturating.h"
#include "base/thread_name.h"

namespace layerserve {
namespace {

double Seconds(SteadyTime::duration d) { return std::chrono::duration<double>(d).count(); }

int64_t InputBytes(const InferRequest& r) { return static_cast<int64_t>(r.input.size()); }

}  // namespace

int64_t DefaultMaxQueueBytes(const BatchPolicy& policy, int64_t hidden) {
  const int64_t bytes = SaturatingMul(SaturatingMul(policy.max_batch_tokens, hidden),
                                      int64_t{4} * kDefaultQueuedBatches);
  return std::max(bytes, kMinDefaultQueueBytes);
}

Batcher::Batcher(BatcherOptions options, Backend* backend, ServerObserver* observer,
                 const Clock* clock)
    : options_(options), backend_(backend), observer_(observer), clock_(clock) {
  for (int i = 0; i < std::max(1, options_.reply_threads); ++i) {
    reply_threads_.emplace_back([this, i] {
      NameThisThread(absl::StrCat("reply-", i));
      RunReplies();
    });
  }
  thread_ = std::thread([this] {
    NameThisThread("batcher");
    Run();
  });
}

Batcher::~Batcher() { Shutdown(); }

absl::Status Batcher::Enqueue(std::unique_ptr<InferRequest>& request) {
  MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (request->session) {
    const SessionParams& session = *request->session;
    if (options_.sessions == nullptr) {
      return absl::FailedPreconditionError(
          "this server keeps no sessions (its backend has no KV cache); send requests without "
          "sequence parameters");
    }
    // A reset while the session still has work would race with that work.
    if (session.start &&
        (queued_sessions_.contains(session.id) || options_.sessions->InFlight(session.id))) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence_start for session ", session.id.ToString(),
          ", which has a request queued or in flight; send it after that request's reply"));
    }
  }
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
  if (request->session) {
    // A session is not idle while a request of it waits (as Triton counts
    // idleness): queued, its session is kept used, here and at every sweep.
    ++queued_sessions_[request->session->id];
    options_.sessions->Touch(request->session->id, request->enqueue_time);
  }
  queued_bytes_ += bytes;
  queue_.push_back(std::move(request));
  observer_->OnQueueDepth(static_cast<int64_t>(queue_.size()));
  if (MayChangeDecisionLocked(*queue_.back())) cv_.Signal();
  return absl::OkStatus();
}

bool Batcher::MayChangeDecisionLocked(const InferRequest& r) const {
  // Awake, the scheduler reads the queue again before it next sleeps.
  if (!sleep_.asleep) return false;
  if (r.deadline && (!sleep_.until || *r.deadline < *sleep_.until)) return true;
  // Only a finished batch frees a slot, and its completion wakes the scheduler.
  if (!sleep_.slot_free) return false;
  // No request could run: this one may be the first that can.
  if (sleep_.eligible_tokens < 0) return true;
  // Waiting for the oldest to be due: only a full batch runs sooner.
  return sleep_.eligible_tokens + r.batch * NextPiece(r) >= options_.policy.max_batch_tokens;
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

int64_t Batcher::NextPiece(const InferRequest& r) const {
  const int64_t remaining = r.seq_len - r.chunk_begin;
  if (!r.session || r.batch <= 0) return remaining;
  const int64_t limit =
      options_.prefill_chunk_tokens > 0
          ? std::min(options_.prefill_chunk_tokens, options_.policy.max_batch_tokens)
          : options_.policy.max_batch_tokens;
  return std::min(remaining, std::max<int64_t>(1, limit / r.batch));
}

void Batcher::UnqueueLocked(const InferRequest& r) {
  queued_bytes_ -= InputBytes(r);
  if (!r.session) return;
  const auto it = queued_sessions_.find(r.session->id);
  if (it != queued_sessions_.end() && --it->second == 0) queued_sessions_.erase(it);
}

void Batcher::DropDeadLocked(SteadyTime now, std::vector<Refused>& refused) {
  const size_t before = queue_.size();
  for (auto it = queue_.begin(); it != queue_.end();) {
    InferRequest& r = **it;
    const bool expired = r.deadline && *r.deadline <= now;
    // A chunked request whose first piece ran is finished, not dropped: its
    // session already holds that piece.
    const bool started = r.chunk_begin > 0;
    if (!started && (expired || (r.is_cancelled && r.is_cancelled()))) {
      UnqueueLocked(r);
      refused.push_back(
          {std::move(*it), expired ? absl::DeadlineExceededError("deadline exceeded while queued")
                                   : absl::CancelledError("request cancelled while queued")});
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  if (queue_.size() != before) observer_->OnQueueDepth(static_cast<int64_t>(queue_.size()));
}

std::shared_ptr<Batch> Batcher::FormBatchLocked(SteadyTime now, std::optional<SteadyTime>* wake_at,
                                                int64_t* eligible_tokens,
                                                std::vector<Refused>& refused) {
  // The requests that may run now, in arrival order: all but those of a
  // session whose step is in flight or that has an earlier request queued.
  std::vector<size_t> eligible;
  std::vector<int64_t> tokens;
  std::vector<int64_t> pieces;
  absl::flat_hash_set<SessionId> seen;
  for (size_t i = 0; i < queue_.size(); ++i) {
    const InferRequest& r = *queue_[i];
    if (r.session) {
      if (!seen.insert(r.session->id).second) continue;
      if (options_.sessions->InFlight(r.session->id)) continue;
    }
    eligible.push_back(i);
    pieces.push_back(NextPiece(r));
    tokens.push_back(r.batch * pieces.back());
  }
  *eligible_tokens = -1;
  if (eligible.empty()) return nullptr;  // a batch in flight will wake us
  *eligible_tokens = std::accumulate(tokens.begin(), tokens.end(), int64_t{0});
  const SteadyTime oldest = queue_[eligible.front()]->enqueue_time;
  BatchDecision decision =
      DecideBatch(options_.policy, tokens, oldest, now,
                  /*device_idle=*/inflight_batches_ == 0, DeviceFreeAtLocked());
  // Draining: run what is queued without waiting for more to arrive.
  if (decision.take == 0 && stopping_) {
    decision = DecideBatch(options_.policy, tokens, now - options_.policy.max_queue_delay, now,
                           /*device_idle=*/false);
  }
  if (decision.take == 0) {
    *wake_at = decision.wake_at;
    return nullptr;
  }
  auto batch = std::make_shared<Batch>();
  for (size_t k = 0; k < decision.take; ++k) {
    std::unique_ptr<InferRequest>& slot = queue_[eligible[k]];
    UnqueueLocked(*slot);
    if (slot->session) {
      // The first piece carries the client's start and position; later
      // pieces append where the previous one ended.
      const SessionParams& session = *slot->session;
      const bool first = slot->chunk_begin == 0;
      absl::StatusOr<SessionStep> step = options_.sessions->BeginStep(
          {.id = session.id,
           .start = first && session.start,
           .batch = slot->batch,
           .tokens = pieces[k],
           .position = first
                           ? session.position
                           : std::optional<int64_t>(slot->chunk_start_position + slot->chunk_begin),
           .end = session.end},
          now);
      if (!step.ok()) {
        if (!first) {
          // Undo the pieces already committed; the request fails whole.
          options_.sessions->Truncate(session.id, slot->chunk_start_position).IgnoreError();
        }
        refused.push_back({std::move(slot), step.status()});
        continue;
      }
      slot->step = *std::move(step);
      slot->chunk_tokens = pieces[k];
      if (first) slot->chunk_start_position = slot->step.position;
    }
    batch->requests.push_back(std::move(slot));
  }
  std::erase_if(queue_, [](const std::unique_ptr<InferRequest>& r) { return r == nullptr; });
  observer_->OnQueueDepth(static_cast<int64_t>(queue_.size()));
  if (batch->requests.empty()) return nullptr;  // every step was refused
  return batch;
}

std::optional<SteadyTime> Batcher::DeviceFreeAtLocked() const {
  std::optional<SteadyTime> free_at;
  for (const auto& [batch, end] : inflight_ends_) {
    if (!end) return std::nullopt;  // a batch of a size not seen before
    if (!free_at || *end > *free_at) free_at = end;
  }
  return free_at;
}

bool Batcher::SweepIdleLocked(SteadyTime now, std::optional<SteadyTime>* wake_at) {
  if (options_.sessions == nullptr) return false;
  const auto timeout = options_.sessions->options().idle_timeout;
  if (timeout <= std::chrono::nanoseconds(0)) return false;
  bool freed = false;
  if (now >= next_sweep_) {
    for (const auto& [id, count] : queued_sessions_) options_.sessions->Touch(id, now);
    freed = options_.sessions->ExpireIdle(now) > 0;
    // A session is freed at most a sweep interval after its timeout passes.
    const auto interval = std::clamp<SteadyTime::duration>(
        std::chrono::duration_cast<SteadyTime::duration>(timeout / 8),
        std::chrono::milliseconds(10), std::chrono::seconds(1));
    next_sweep_ = now + interval;
  }
  if (!*wake_at || next_sweep_ < **wake_at) *wake_at = next_sweep_;
  return freed;
}

void Batcher::Run() {
  const int max_inflight = std::max(1, backend_->MaxInflightBatches());
  for (;;) {
    std::vector<Refused> refused;
    std::shared_ptr<Batch> batch;
    SteadyTime now;
    bool sessions_changed = false;
    {
      MutexLock lock(&mu_);
      now = clock_->Now();
      DropDeadLocked(now, refused);
      if (stopping_ && queue_.empty() && inflight_batches_ == 0 && refused.empty()) return;

      std::optional<SteadyTime> wake_at;
      sessions_changed = SweepIdleLocked(now, &wake_at);
      const bool slot_free = inflight_batches_ < max_inflight;
      int64_t eligible_tokens = -1;
      if (!queue_.empty() && slot_free) {
        std::optional<SteadyTime> batch_wake;
        batch = FormBatchLocked(now, &batch_wake, &eligible_tokens, refused);
        if (batch) {
          ++inflight_batches_;
          sessions_changed =
              sessions_changed || std::any_of(batch->requests.begin(), batch->requests.end(),
                                              [](const auto& r) { return r->session.has_value(); });
        } else if (batch_wake && (!wake_at || *batch_wake < *wake_at)) {
          wake_at = batch_wake;
        }
        sessions_changed = sessions_changed || !refused.empty();
      }
      if (!batch && refused.empty() && !sessions_changed) {
        // Also wake for the earliest request deadline, so expired requests
        // are answered even while the backend is busy.
        for (const auto& r : queue_) {
          if (r->deadline && (!wake_at || *r->deadline < *wake_at)) wake_at = r->deadline;
        }
        if (!wake_) {
          sleep_ = {.asleep = true,
                    .slot_free = slot_free,
                    .eligible_tokens = eligible_tokens,
                    .until = wake_at};
          if (wake_at) {
            const auto wait = std::max(*wake_at - now, SteadyTime::duration::zero());
            cv_.WaitFor(&mu_, wait);
          } else {
            cv_.Wait(&mu_);
          }
          sleep_.asleep = false;
        }
        wake_ = false;
        continue;
      }
    }

    // Outside the lock: report the sessions, answer refused requests, start
    // the batch.
    if (sessions_changed && options_.sessions != nullptr) {
      observer_->OnSessions(options_.sessions->Stats());
    }
    for (Refused& r : refused) {
      r.request->queue_seconds = Seconds(now - r.request->enqueue_time);
      observer_->OnDequeued({r.request->queue_seconds});
      r.request->on_done(std::move(r.status));
    }
    if (batch) {
      for (auto& r : batch->requests) {
        r->batch_requests = static_cast<int64_t>(batch->requests.size());
        if (r->chunk_begin > 0) continue;  // a later piece: dequeued already
        r->queue_seconds = Seconds(now - r->enqueue_time);
        observer_->OnDequeued({r->queue_seconds});
      }
      batch->Pack();
      const SteadyTime start = clock_->Now();
      {
        MutexLock lock(&mu_);
        const std::optional<SteadyTime::duration> duration =
            durations_.Predict(batch->total_tokens);
        inflight_ends_.push_back(
            {batch.get(), duration ? std::optional<SteadyTime>(start + *duration) : std::nullopt});
      }
      backend_->Execute(batch, [this, batch, start](absl::Status status) {
        OnBatchDone(batch, start, std::move(status));
      });
    }
  }
}

void Batcher::OnBatchDone(const std::shared_ptr<Batch>& batch, SteadyTime start,
                          absl::Status status) {
  const SteadyTime::duration compute = clock_->Now() - start;
  const double compute_seconds = Seconds(compute);
  // Recorded before the replies, so statistics read after a reply include it.
  observer_->OnBatchExecuted({.requests = static_cast<int64_t>(batch->requests.size()),
                              .tokens = batch->total_tokens,
                              .compute_seconds = compute_seconds,
                              .ok = status.ok(),
                              .input_seconds = batch->timings.input_seconds,
                              .output_seconds = batch->timings.output_seconds,
                              .launch = batch->timings.launch,
                              .expert_tokens = batch->expert_tokens});
  for (auto& r : batch->requests) r->compute_seconds += compute_seconds;
  // Sessions step forward (or back) before any reply, so that a client's
  // next request sees this one's effect.
  std::vector<absl::Status> statuses(batch->requests.size(), status);
  std::vector<std::unique_ptr<InferRequest>> next_pieces;  // in batch order
  if (batch->has_sessions && options_.sessions != nullptr) {
    const SteadyTime now = clock_->Now();
    for (size_t i = 0; i < batch->requests.size(); ++i) {
      InferRequest& r = *batch->requests[i];
      if (!r.session) continue;
      const bool last_piece = r.chunk_begin + r.piece_tokens() >= r.seq_len;
      absl::Status finished = options_.sessions->FinishStep(r.session->id, status.ok(),
                                                            r.session->end && last_piece, now);
      if (!finished.ok()) {
        statuses[i] = std::move(finished);  // a bug: never hide it
      } else if (status.ok() && !last_piece) {
        r.chunk_begin += r.piece_tokens();
        r.chunk_tokens = 0;
        next_pieces.push_back(std::move(batch->requests[i]));
        continue;
      }
      if (!status.ok() && r.chunk_begin > 0) {
        options_.sessions->Truncate(r.session->id, r.chunk_start_position).IgnoreError();
      }
    }
    observer_->OnSessions(options_.sessions->Stats());
  }
  {
    MutexLock lock(&reply_mu_);
    for (size_t i = 0; i < batch->requests.size(); ++i) {
      if (batch->requests[i] == nullptr) continue;  // its next piece is queued
      replies_.push_back({batch, i, std::move(statuses[i]), start + compute});
    }
    reply_cv_.SignalAll();
  }
  // The slot is free as soon as the results are on the host; the next batch
  // need not wait for this one's replies.
  MutexLock lock(&mu_);
  std::erase_if(inflight_ends_, [&](const auto& e) { return e.first == batch.get(); });
  if (status.ok() && batch->total_tokens > 0) {
    durations_.Observe(batch->total_tokens, compute);
  }
  // Next pieces go back to the front, in order: they are the oldest work.
  for (auto it = next_pieces.rbegin(); it != next_pieces.rend(); ++it) {
    queued_bytes_ += InputBytes(**it);
    ++queued_sessions_[(*it)->session->id];
    queue_.push_front(std::move(*it));
  }
  if (!next_pieces.empty()) observer_->OnQueueDepth(static_cast<int64_t>(queue_.size()));
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
    InferRequest& request = *reply.batch->requests[reply.index];
    request.reply_wait_seconds = Seconds(clock_->Now() - reply.done);
    request.on_done(std::move(reply.status));
  }
}

}  // namespace layerserve
