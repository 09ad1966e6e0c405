// The dynamic batcher: a bounded queue of InferRequests and one scheduling
// thread that forms token-level batches (see batch_policy.h) and hands them
// to the backend whenever it has a free slot.
//
// Threading: Enqueue() is called from gRPC reactions and never blocks on
// compute. The scheduling thread owns batch formation; completions arrive on
// backend threads, which only record the batch, free its slot and queue its
// replies: a pool of reply threads runs the requests' on_done (building and
// sending each response costs tens of microseconds, so a batch of 20 replied
// in line would keep its backend stream idle for most of a millisecond).
// Requests whose deadline passed or that were cancelled while queued are
// answered (DEADLINE_EXCEEDED / CANCELLED) without running.
//
// Sessions (continuous batching): a session's requests run one at a time, in
// arrival order, never two in one batch; the others' requests, stateless or
// of other sessions, batch with them at token level. The scheduler skips a
// queued request while an earlier one of its session is queued or in
// flight, and steps each session it takes through the session table as the
// batch forms (BeginStep: the session's state is checked and its KV blocks
// reserved only then, so a request dropped or refused before that leaves its
// session as it was). When the batch is done, FinishStep commits or undoes
// each step before any reply goes out, so a client's next request always
// sees its previous one's effect. Idle sessions are swept by the same thread.
// A session request longer than prefill_chunk_tokens is computed in pieces
// (InferRequest::chunk_begin): after each piece it goes back to the front of
// the queue, and it is answered once its last piece is done; a piece that
// fails rolls the session back to where the request began.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "base/mutex.h"
#include "server/core/backend.h"
#include "server/core/batch_policy.h"
#include "server/core/clock.h"
#include "server/core/observer.h"
#include "server/core/request.h"
#include "server/core/sessions.h"

namespace layerserve {

// Full batches of FP32 tokens the queue holds by default (max_queue_bytes 0):
// enough to keep every backend slot busy and the next batches forming, while
// a burst of large requests cannot hold more than this in memory.
inline constexpr int kDefaultQueuedBatches = 8;
// The default's floor: with small batches (--max-batch-tokens of one
// request, i.e. batching off) 8 batches would be 8 requests, and a queue that
// small refuses ordinary load. 64 MiB holds 4096 one-token FP32 requests of
// Llama-3-8B's hidden size.
inline constexpr int64_t kMinDefaultQueueBytes = int64_t{64} << 20;

struct BatcherOptions {
  BatchPolicy policy;
  int64_t max_queue_size = 1024;  // requests waiting; beyond it Enqueue fails
  // Threads running on_done of finished batches (>= 1): each reply costs
  // tens of microseconds, so a batch of a hundred waits for the last of
  // its replies ~(100 / reply_threads) of them (InferRequest::reply_wait_seconds).
  int reply_threads = 4;
  // Bytes of input tensor the waiting requests may hold together; beyond it
  // Enqueue fails (RESOURCE_EXHAUSTED), except that an empty queue takes any
  // request. 0: DefaultMaxQueueBytes(policy, hidden of the requests), i.e.
  // kDefaultQueuedBatches full batches of FP32 tokens (8 x 16 MiB for the
  // demo model, 8 x 128 MiB for Llama-3-8B at 8192 tokens), at least 64 MiB.
  int64_t max_queue_bytes = 0;
  // The session table that session requests (InferRequest::session) step
  // through; not owned, must outlive the Batcher. Null: the backend keeps no
  // KV cache, and Enqueue refuses session requests (FAILED_PRECONDITION).
  SessionTable* sessions = nullptr;
  // Chunked prefill: the most tokens (B x T) of one session request computed
  // in one batch; a longer request runs in pieces, one batch after another,
  // each a step of its session, so it never fills a batch that other
  // sessions' decode steps are waiting for. 0: policy.max_batch_tokens.
  int64_t prefill_chunk_tokens = 0;
};

// kDefaultQueuedBatches x policy.max_batch_tokens x hidden x 4 bytes, at
// least kMinDefaultQueueBytes, saturating at INT64_MAX.
int64_t DefaultMaxQueueBytes(const BatchPolicy& policy, int64_t hidden);

class Batcher {
 public:
  // `backend`, `observer` and `clock` must outlive the Batcher.
  Batcher(BatcherOptions options, Backend* backend, ServerObserver* observer, const Clock* clock);
  ~Batcher();  // Shutdown(): drains queued and in-flight work first

  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Queues the request. On success the request's on_done will be called
  // later. On failure (queue full, by count or by bytes: RESOURCE_EXHAUSTED;
  // shutting down: UNAVAILABLE; a session request without a session table,
  // or a sequence_start naming a session with a request queued or in flight:
  // FAILED_PRECONDITION) the status is returned, on_done is NOT called, and
  // the request is returned to the caller through `request` (left non-null).
  absl::Status Enqueue(std::unique_ptr<InferRequest>& request);

  // Wakes the scheduler so it re-reads the clock (tests with a FakeClock).
  void Wake();

  // Stops accepting work, runs everything already queued, waits for in-flight
  // batches and their replies, then joins the threads. Idempotent.
  void Shutdown();

  int64_t queue_depth() const;

  // The session table (BatcherOptions::sessions; null when none).
  const SessionTable* sessions() const { return options_.sessions; }

 private:
  void Run();
  // A request answered without running, and why.
  struct Refused {
    std::unique_ptr<InferRequest> request;
    absl::Status status;
  };
  // Removes expired or cancelled requests from the queue; they are answered
  // after the lock is released (moved into `refused`).
  void DropDeadLocked(SteadyTime now, std::vector<Refused>& refused)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forms the next batch from the queue if the policy says run now; else
  // returns null and sets *wake_at to when it may. Session requests whose
  // BeginStep fails go to `refused`. Returns null with nothing refused when
  // no queued request may run yet.
  // *eligible_tokens: the tokens of the requests that could run (-1: none),
  // for MayChangeDecisionLocked.
  std::shared_ptr<Batch> FormBatchLocked(SteadyTime now, std::optional<SteadyTime>* wake_at,
                                         int64_t* eligible_tokens, std::vector<Refused>& refused)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees idle sessions when a sweep is due; returns whether any was freed
  // and lowers *wake_at to the next sweep.
  bool SweepIdleLocked(SteadyTime now, std::optional<SteadyTime>* wake_at)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnqueueLocked(const InferRequest& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether queueing `r` can change what the sleeping scheduler decided
  // (see sleep_), so that Enqueue wakes it only then: a wake per request
  // costs a context switch each, where one per batch is enough.
  bool MayChangeDecisionLocked(const InferRequest& r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // When every batch in flight is predicted to have ended (DecideBatch's
  // device_free_at); unset when none is in flight or one has no prediction.
  std::optional<SteadyTime> DeviceFreeAtLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tokens per sequence of the request's next piece (all that remain for a
  // stateless request or one within the chunk limit).
  int64_t NextPiece(const InferRequest& r) const;
  void OnBatchDone(const std::shared_ptr<Batch>& batch, SteadyTime start, absl::Status status);
  void RunReplies();

  // One request of a finished batch, waiting for a reply thread.
  struct Reply {
    std::shared_ptr<Batch> batch;
    size_t index = 0;
    absl::Status status;
    SteadyTime done{};  // when the batch ended
  };

  const BatcherOptions options_;
  Backend* const backend_;
  ServerObserver* const observer_;
  const Clock* const clock_;

  mutable Mutex mu_;
  std::deque<std::unique_ptr<InferRequest>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // sum of queue_'s input sizes
  // Queued requests per session (sessions with none are absent).
  absl::flat_hash_map<SessionId, int64_t> queued_sessions_ ABSL_GUARDED_BY(mu_);
  SteadyTime next_sweep_ ABSL_GUARDED_BY(mu_){};
  int inflight_batches_ ABSL_GUARDED_BY(mu_) = 0;
  // Batch compute times seen so far, and the predicted end of each batch in
  // flight (unset: no prediction for its size yet), for just-in-time
  // formation (BatchPolicy::max_device_wait).
  BatchDurationModel durations_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<const Batch*, std::optional<SteadyTime>>> inflight_ends_
      ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  // What the scheduler knew when it last went to sleep: whether a slot was
  // free, the tokens of the requests that could run (-1: none), and when it
  // wakes by itself (unset: only when signalled).
  struct Sleep {
    bool asleep = false;
    bool slot_free = false;
    int64_t eligible_tokens = -1;
    std::optional<SteadyTime> until;
  };
  Sleep sleep_ ABSL_GUARDED_BY(mu_);
  CondVar cv_;  // signalled whenever the scheduling decision may change
  std::thread thread_;

  Mutex reply_mu_;
  std::deque<Reply> replies_ ABSL_GUARDED_BY(reply_mu_);
  bool replies_stopping_ ABSL_GUARDED_BY(reply_mu_) = false;
  CondVar reply_cv_;
  std::vector<std::thread> reply_threads_;
};

}  // namespace layerserve
