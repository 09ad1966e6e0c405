// Server-side sessions: which KV cache blocks hold each open sequence's keys
// and values, so that generating through a layer span costs one step per new
// token instead of recomputing the whole prefix.
//
// A session is named by a SessionId (Triton's sequence_id: an int64 or a
// string) and holds B sequences (B fixed when the session starts), each of
// length L tokens (the same L for all B), each with a block table: the ids of
// the KV pool blocks (kv_blocks.h) that hold its tokens 0..L-1, in order. The
// backend owns the storage; the table decides which block ids each sequence
// uses, and the backend writes and reads K/V through the tables it is given.
//
// The life of one step (one request of a session):
//   1. BeginStep(request, now), before the request is queued: validates it
//      against the session, creates or resets the session on start, applies a
//      rollback (sequence_position < L truncates the sequences to it), reserves
//      blocks for T more tokens per sequence and marks the session in flight.
//      Returns the block tables and the position where the T new tokens go.
//   2. The backend computes the step: attends over positions 0..position+T-1
//      and writes the new tokens' K/V at rows position..position+T-1.
//   3. FinishStep(id, ok, end, now), once the step is answered: on success L
//      grows by T (and `end` frees the session); on failure the reserved blocks
//      go back to the pool and nothing else changes.
// Every call is all-or-nothing: an error leaves the table exactly as it was
// (save that BeginStep frees an idle session it comes across, as ExpireIdle
// would have).
//
// What a failed step keeps: BeginStep commits a reset (start) and a rollback
// before the step runs, because the backend overwrites the positions the
// rollback dropped; after FinishStep(ok = false) the session has the length
// it had after that truncation (L for a plain append, `position` after a
// rollback, 0 after a start) and the blocks for it, with the same ids. The
// K/V rows past L may hold the failed step's writes; they are never read,
// since every step writes before it reads past L.
//
// Ownership and threading: the table owns the session records and the block
// allocator (one per backend pool); it never touches KV memory. Every public
// method is thread-safe and takes one internal lock for O(B x blocks per
// sequence) work with no I/O or waiting, so it may be called from gRPC
// reactions, the batcher and backend completion threads alike. Time is a
// SteadyTime argument (injected clock), never read here, so tests need no
// sleeps.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "server/core/clock.h"
#include "server/core/kv_blocks.h"

namespace layerserve {

// A session's name as the protocol carries it: Triton's sequence_id, an int64
// or a string. The two kinds never compare equal: 7 and "7" are two sessions.
// Which values are legal (Triton reserves 0 and "" for "no sequence") is the
// protocol layer's business; the table accepts any.
//
// An id also carries its owner: the identity of the caller that named it, as
// the edge authenticates callers (a client certificate's; empty where the
// server authenticates none). Two callers' ids never compare equal, so a
// caller sees only its own sessions, and another's id is as unknown as one
// that was never opened. The owner is never printed.
class SessionId {
 public:
  SessionId() = default;  // the integer 0
  explicit SessionId(int64_t id) : value_(id) {}
  explicit SessionId(std::string id) : value_(std::move(id)) {}

  // This id as `owner` names it.
  SessionId OwnedBy(std::string owner) const {
    SessionId id = *this;
    id.owner_ = std::move(owner);
    return id;
  }
  const std::string& owner() const { return owner_; }

  bool is_string() const { return std::holds_alternative<std::string>(value_); }
  // Requires !is_string().
  int64_t int_value() const { return std::get<int64_t>(value_); }
  // Requires is_string().
  const std::string& string_value() const { return std::get<std::string>(value_); }

  // For error messages and logs: an integer as itself (42), a string quoted
  // with C escapes ("user-7\n"), cut after kMaxPrintedBytes bytes of the
  // string with the full size appended ("aaaa..." (300 bytes)). Never longer
  // than about 4 x kMaxPrintedBytes + 32 characters, whatever the id.
  static constexpr size_t kMaxPrintedBytes = 64;
  std::string ToString() const;

  friend bool operator==(const SessionId& a, const SessionId& b) {
    return a.value_ == b.value_ && a.owner_ == b.owner_;
  }
  friend bool operator!=(const SessionId& a, const SessionId& b) { return !(a == b); }
  template <typename H>
  friend H AbslHashValue(H h, const SessionId& id) {
    return H::combine(std::move(h), id.value_, id.owner_);
  }

 private:
  std::variant<int64_t, std::string> value_{int64_t{0}};
  std::string owner_;
};

struct SessionTableOptions {
  // Blocks in the KV pool (the backend's byte budget divided by the bytes of
  // one block) and tokens per block. num_blocks >= 0, block_tokens >= 1.
  int32_t num_blocks = 0;
  int64_t block_tokens = 16;
  // Open sessions at once; starting one more is RESOURCE_EXHAUSTED. >= 1.
  int64_t max_sessions = 1024;
  // Tokens one session may hold, B x L over all its sequences (a bound on
  // one client's share of the pool); 0: no bound beyond the pool.
  int64_t max_session_tokens = 0;
  // A session not used for this long is freed by ExpireIdle; a later request
  // naming it is NOT_FOUND "expired". Zero: sessions never expire.
  std::chrono::nanoseconds idle_timeout = std::chrono::seconds(0);
  // Ids of idle-expired sessions remembered, so that a late request hears
  // "expired" rather than "not found"; the oldest are forgotten first. >= 0.
  int64_t remembered_expired = 4096;
};

// One request of a session, as BeginStep needs it.
struct SessionStepRequest {
  SessionId id;
  bool start = false;  // sequence_start: create the session, or reset it
  int64_t batch = 0;   // B, sequences in the request (>= 1)
  int64_t tokens = 0;  // T, new tokens per sequence (>= 0)
  // sequence_position: the length the request expects the session to have.
  // Equal to L: append. Smaller: roll back to it first. Larger: an error.
  // Unset: append at L.
  std::optional<int64_t> position;
  // sequence_end: the session ends after this step. A step that ends its
  // session and finds no KV blocks for its tokens still ends it (the blocks
  // go back to the pool; the step is refused, uncomputed), so a client can
  // always give back what it holds, also from a full pool.
  bool end = false;
};

// What a backend needs to compute one step.
struct SessionStep {
  // Where the T new tokens of every sequence go (equal for all B sequences,
  // since they have one length): token t of the request is position + t.
  int64_t position = 0;
  int64_t tokens = 0;        // T
  int64_t block_tokens = 0;  // tokens per block, as in the table's options
  // One table per sequence, B in all, each covering positions
  // 0..position+T-1 (BlocksForTokens(position + T) ids). Copies: the session
  // cannot change while the step is in flight.
  std::vector<std::vector<KvBlockId>> block_tables;
};

// A session as it stands, for tests, debugging and metadata.
struct SessionInfo {
  int64_t batch = 0;
  int64_t length = 0;  // L: tokens per sequence committed by finished steps
  bool in_flight = false;
  SteadyTime last_used{};
  std::vector<std::vector<KvBlockId>> block_tables;  // including an in-flight step's blocks
};

// Counters for metrics. The freed_* counters only grow.
struct SessionTableStats {
  int64_t sessions_open = 0;
  int64_t sessions_in_flight = 0;
  int64_t blocks_used = 0;
  int64_t blocks_capacity = 0;
  int64_t freed_end = 0;           // sessions freed by a successful step with sequence_end
  int64_t freed_idle = 0;          // sessions freed by the idle timeout
  int64_t freed_reset = 0;         // sessions replaced by a sequence_start naming them
  int64_t freed_drain = 0;         // sessions dropped by a drain (DropForDrain)
  int64_t rejected_no_blocks = 0;  // steps refused for want of free KV cache blocks
};

class SessionTable {
 public:
  // INVALID_ARGUMENT naming the first option out of range.
  static absl::StatusOr<std::unique_ptr<SessionTable>> Create(const SessionTableOptions& options);

  SessionTable(const SessionTable&) = delete;
  SessionTable& operator=(const SessionTable&) = delete;

  // Starts a step of `request.id` at `now`; see the file comment. On success
  // the session is in flight until FinishStep. Errors, each naming the
  // session and the numbers involved, leave the table unchanged (except that
  // a session found idle past its timeout is expired on the way, as
  // ExpireIdle would):
  //   INVALID_ARGUMENT    batch < 1, tokens < 0, position < 0; without start,
  //                       a batch different from the session's B.
  //   NOT_FOUND           without start: no such session ("expired" when it
  //                       was freed for idleness and is still remembered,
  //                       "dropped by a drain" after DropForDrain).
  //   UNAVAILABLE         a start after DropForDrain: the table opens no
  //                       session any more.
  //   FAILED_PRECONDITION a step of the session is already in flight (also
  //                       for a start); position larger than L (0 on start).
  //   RESOURCE_EXHAUSTED  B larger than the pool's block count (a sequence
  //                       needs a block for its first token);
  //                       B x (position + T) over max_session_tokens; not
  //                       enough free KV blocks (the blocks a rollback or
  //                       reset gives back count as free); starting a new
  //                       session when max_sessions are open (idle ones are
  //                       expired first to make room).
  absl::StatusOr<SessionStep> BeginStep(const SessionStepRequest& request, SteadyTime now);

  // Ends the in-flight step of `id`. ok: L grows by the step's T, and `end`
  // then frees the session (its blocks return to the pool). !ok (the step was
  // not computed, or not completely): the blocks BeginStep reserved return to
  // the pool and the session keeps its length; `end` is ignored, so a client
  // may retry the step (an abandoned session is freed by the idle timeout).
  // Either way the session is no longer in flight and was last used at `now`.
  // FAILED_PRECONDITION when `id` has no step in flight (a caller's bug).
  absl::Status FinishStep(const SessionId& id, bool ok, bool end, SteadyTime now);

  // Shortens session `id` to `length` tokens per sequence, freeing the blocks
  // past it; a no-op when it is not longer. For undoing the committed pieces
  // of a chunked request whose later piece failed. NOT_FOUND: no such
  // session; FAILED_PRECONDITION: a step is in flight; INVALID_ARGUMENT:
  // length < 0.
  absl::Status Truncate(const SessionId& id, int64_t length);

  // Frees every session not in flight whose last use is idle_timeout or more
  // before `now`, remembers their ids as expired (least recently used first,
  // so the oldest are the first forgotten), and returns how many were
  // freed. Sessions in flight never expire. Does nothing when idle_timeout is 0.
  int64_t ExpireIdle(SteadyTime now);

  SessionTableStats Stats() const;

  // The end of a drain (the server is shutting down and its time for open
  // sessions to end has run out): frees every session not in flight now and
  // each session in flight as its step finishes (FinishStep, whatever its
  // `end`), counting them under freed_drain, and remembers their ids, so
  // that a later step naming one is NOT_FOUND "dropped by a drain" rather
  // than "not found". From then on BeginStep opens no session (UNAVAILABLE
  // for a start). Returns how many it freed now. Idempotent.
  int64_t DropForDrain();

  // OK when `id` names an open session; otherwise the NOT_FOUND a step
  // naming it would get from BeginStep (not found, expired, or dropped by a
  // drain). O(1).
  absl::Status CheckOpen(const SessionId& id) const;

  // Marks session `id` used at `now` (nothing when none is open under it), so
  // that it does not expire while a request of it waits in a queue. O(1).
  void Touch(const SessionId& id, SteadyTime now);

  // Whether `id` names an open session with a step in flight. O(1).
  bool InFlight(const SessionId& id) const;

  // The session as it stands; nullopt when none is open under `id`.
  std::optional<SessionInfo> Find(const SessionId& id) const;

  // Checks the table's invariants: every session holds BlocksForTokens(L) blocks
  // per sequence plus those of its in-flight step, no block is held twice, and
  // the allocator's used count equals the blocks held. INTERNAL naming the
  // first violation. For tests; O(blocks).
  absl::Status CheckConsistency() const;

  const SessionTableOptions& options() const { return options_; }

 private:
  struct Session {
    int64_t batch = 0;
    int64_t length = 0;
    std::vector<std::vector<KvBlockId>> block_tables;
    SteadyTime last_used{};
    bool in_flight = false;
    int64_t step_tokens = 0;      // T of the step in flight
    int64_t step_new_blocks = 0;  // blocks per sequence the step in flight reserved
  };

  explicit SessionTable(const SessionTableOptions& options);

  bool IsIdleLocked(const Session& s, SteadyTime now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the session's blocks and removes it; counts it under `counter`.
  void EraseLocked(const SessionId& id, int64_t* counter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RememberExpiredLocked(const SessionId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetExpiredLocked(const SessionId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t ExpireIdleLocked(SteadyTime now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status NotFoundLocked(const SessionId& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SessionTableOptions options_;

  mutable Mutex mu_;
  KvBlockAllocator blocks_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<SessionId, Session> sessions_ ABSL_GUARDED_BY(mu_);
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  // Recently expired ids, oldest first, each with the serial number it was
  // remembered under; expired_ maps an id to its latest serial, so an entry
  // forgotten (the id started again) or re-remembered is skipped on eviction.
  std::deque<std::pair<SessionId, uint64_t>> expired_order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<SessionId, uint64_t> expired_ ABSL_GUARDED_BY(mu_);
  uint64_t next_expired_serial_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t freed_end_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t freed_idle_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t freed_reset_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t freed_drain_ ABSL_GUARDED_BY(mu_) = 0;
  // Set by DropForDrain: sessions are freed as their steps finish, and the
  // ids freed so are remembered (at most the sessions open then).
  bool dropped_for_drain_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<SessionId> dropped_ ABSL_GUARDED_BY(mu_);
  int64_t rejected_no_blocks_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace layerserve
