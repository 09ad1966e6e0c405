// The session table: see sessions.h for what each call guarantees.
#include "server/core/sessions.h"

#include <algorithm>
#include <limits>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace layerserve {
namespace {

// "1 sequence", "3 sequences": for messages.
std::string Sequences(int64_t n) { return absl::StrCat(n, n == 1 ? " sequence" : " sequences"); }

}  // namespace

std::string SessionId::ToString() const {
  if (!is_string()) return absl::StrCat(int_value());
  const std::string& s = string_value();
  if (s.size() <= kMaxPrintedBytes) return absl::StrCat("\"", absl::CHexEscape(s), "\"");
  return absl::StrCat("\"", absl::CHexEscape(absl::string_view(s).substr(0, kMaxPrintedBytes)),
                      "...\" (", s.size(), " bytes)");
}

absl::StatusOr<std::unique_ptr<SessionTable>> SessionTable::Create(
    const SessionTableOptions& options) {
  if (options.num_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache blocks must be >= 0, got ", options.num_blocks));
  }
  if (options.block_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens per KV cache block must be >= 1, got ", options.block_tokens));
  }
  if (options.max_sessions < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max sessions must be >= 1, got ", options.max_sessions));
  }
  if (options.max_session_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max session tokens must be >= 0 (0: no limit), got ", options.max_session_tokens));
  }
  if (options.idle_timeout < std::chrono::nanoseconds(0)) {
    return absl::InvalidArgumentError("session idle timeout must be >= 0 (0: never)");
  }
  if (options.remembered_expired < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("remembered expired sessions must be >= 0, got ", options.remembered_expired));
  }
  return std::unique_ptr<SessionTable>(new SessionTable(options));
}

SessionTable::SessionTable(const SessionTableOptions& options)
    : options_(options), blocks_(options.num_blocks) {}

absl::StatusOr<SessionStep> SessionTable::BeginStep(const SessionStepRequest& request,
                                                    SteadyTime now) {
  const SessionId& id = request.id;
  if (request.batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("session ", id.ToString(), ": batch size ", request.batch, " is not >= 1"));
  }
  if (request.tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("session ", id.ToString(), ": token count ", request.tokens, " is negative"));
  }
  if (request.position.has_value() && *request.position < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session ", id.ToString(), ": sequence_position ", *request.position, " is negative"));
  }

  if (request.batch > options_.num_blocks) {
    // Each sequence needs a block for its first token; this bound also keeps
    // a huge B with T = 0 from building huge (empty) block tables.
    return absl::ResourceExhaustedError(
        absl::StrCat("session ", id.ToString(), ": ", Sequences(request.batch),
                     " are more than the KV cache's ", options_.num_blocks, " blocks"));
  }

  MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it != sessions_.end() && IsIdleLocked(it->second, now)) {
    // Idle past its timeout but not yet swept: expire it now, so whether a
    // late request finds its session does not depend on when a sweep ran.
    EraseLocked(id, &freed_idle_);
    RememberExpiredLocked(id);
    it = sessions_.end();
  }
  Session* s = it == sessions_.end() ? nullptr : &it->second;
  if (s != nullptr && s->in_flight) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id.ToString(),
                     " already has a request in flight; a session runs one request at a time, "
                     "so send the next after the previous one's reply"));
  }
  if (request.start && dropped_for_drain_) {
    return absl::UnavailableError(absl::StrCat(
        "cannot start session ", id.ToString(),
        ": the server is draining and opens no new session; start it on another replica"));
  }
  if (!request.start) {
    if (s == nullptr) return NotFoundLocked(id);
    if (request.batch != s->batch) {
      return absl::InvalidArgumentError(absl::StrCat(
          "session ", id.ToString(), " holds ", Sequences(s->batch), " but the request has ",
          request.batch, " (the batch size is fixed by the request with sequence_start)"));
    }
  }

  // The length the sequences have once a reset or rollback is applied.
  const int64_t length = request.start ? 0 : s->length;
  const int64_t position = request.position.value_or(length);
  if (position > length) {
    return absl::FailedPreconditionError(
        request.start ? absl::StrCat("session ", id.ToString(), ": sequence_position ", position,
                                     " on a sequence_start request (a new session has length 0)")
                      : absl::StrCat("session ", id.ToString(), ": sequence_position ", position,
                                     " is past the session's length ", length));
  }
  if (request.tokens > std::numeric_limits<int64_t>::max() - position ||
      (options_.max_session_tokens > 0 &&
       position + request.tokens > options_.max_session_tokens / request.batch)) {
    // As when the pool is full (below): a session its client asked to end
    // is ended, whatever its last step would have needed.
    const bool ended = request.end && s != nullptr;
    if (ended) EraseLocked(id, &freed_end_);
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", id.ToString(), ": ", Sequences(request.batch), " x (", position, " + ",
        request.tokens, ") tokens would exceed the limit of ", options_.max_session_tokens,
        " tokens per session",
        ended ? "; the step was not computed, and the session is ended as sequence_end asked"
              : ""));
  }
  const int64_t new_length = position + request.tokens;

  if (s == nullptr && static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    ExpireIdleLocked(now);
    if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot start session ", id.ToString(), ": ", sessions_.size(),
                       " sessions are open, the most allowed is ", options_.max_sessions));
    }
  }

  // Blocks per sequence kept, and reserved for the step; the blocks a reset
  // or rollback gives back count as free.
  const int64_t keep = BlocksForTokens(position, options_.block_tokens);
  const int64_t new_per_sequence = BlocksForTokens(new_length, options_.block_tokens) - keep;
  int64_t given_back = 0;
  if (s != nullptr) {
    const int64_t held = BlocksForTokens(s->length, options_.block_tokens);
    given_back = request.start ? s->batch * held : s->batch * (held - keep);
  }
  const int64_t available = blocks_.free_blocks() + given_back;
  if (new_per_sequence > 0 && request.batch > available / new_per_sequence) {
    ++rejected_no_blocks_;
    std::string needed = request.batch <= std::numeric_limits<int64_t>::max() / new_per_sequence
                             ? absl::StrCat(request.batch * new_per_sequence)
                             : "too many";
    // The client asked to end the session: end it anyway, so that a full
    // pool never keeps sessions their clients want to give back.
    const bool ended = request.end && s != nullptr;
    if (ended) EraseLocked(id, &freed_end_);
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", id.ToString(), ": out of KV cache blocks: ", needed, " needed (",
        Sequences(request.batch), " x ", new_per_sequence, " blocks), ", available, " of ",
        blocks_.capacity(), " free",
        given_back > 0 ? absl::StrCat(" (", given_back, " of them this request's to give back)")
                       : "",
        ended ? "; the step was not computed, and the session is ended as sequence_end asked"
              : ""));
  }

  // Checks done: from here on nothing fails.
  if (s == nullptr) {
    ForgetExpiredLocked(id);
    s = &sessions_[id];
  } else if (request.start) {
    for (const auto& table : s->block_tables) blocks_.Free(table).IgnoreError();
    ++freed_reset_;
  }
  if (request.start) {
    s->batch = request.batch;
    s->block_tables.assign(static_cast<size_t>(request.batch), {});
  } else {
    for (auto& table : s->block_tables) {
      const auto dropped = absl::MakeConstSpan(table).subspan(static_cast<size_t>(keep));
      blocks_.Free(dropped).IgnoreError();
      table.resize(static_cast<size_t>(keep));
    }
  }
  s->length = position;
  for (auto& table : s->block_tables) blocks_.Allocate(new_per_sequence, &table).IgnoreError();
  s->in_flight = true;
  s->step_tokens = request.tokens;
  s->step_new_blocks = new_per_sequence;
  s->last_used = now;
  ++in_flight_;

  SessionStep step;
  step.position = position;
  step.tokens = request.tokens;
  step.block_tokens = options_.block_tokens;
  step.block_tables = s->block_tables;
  return step;
}

absl::Status SessionTable::FinishStep(const SessionId& id, bool ok, bool end, SteadyTime now) {
  MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || !it->second.in_flight) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id.ToString(), " has no step in flight to finish"));
  }
  Session& s = it->second;
  s.in_flight = false;
  --in_flight_;
  s.last_used = now;
  if (ok) {
    s.length += s.step_tokens;
  } else {
    for (auto& table : s.block_tables) {
      const size_t kept = table.size() - static_cast<size_t>(s.step_new_blocks);
      blocks_.Free(absl::MakeConstSpan(table).subspan(kept)).IgnoreError();
      table.resize(kept);
    }
  }
  s.step_tokens = 0;
  s.step_new_blocks = 0;
  if (ok && end) {
    EraseLocked(id, &freed_end_);
  } else if (dropped_for_drain_) {
    EraseLocked(id, &freed_drain_);
    dropped_.insert(id);
  }
  return absl::OkStatus();
}

absl::Status SessionTable::Truncate(const SessionId& id, int64_t length) {
  MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return NotFoundLocked(id);
  Session& s = it->second;
  if (s.in_flight) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id.ToString(), " has a step in flight; it cannot be truncated"));
  }
  if (length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("session ", id.ToString(), ": length ", length, " is negative"));
  }
  if (length >= s.length) return absl::OkStatus();
  const size_t keep = static_cast<size_t>(BlocksForTokens(length, options_.block_tokens));
  for (auto& table : s.block_tables) {
    blocks_.Free(absl::MakeConstSpan(table).subspan(keep)).IgnoreError();
    table.resize(keep);
  }
  s.length = length;
  return absl::OkStatus();
}

int64_t SessionTable::ExpireIdle(SteadyTime now) {
  MutexLock lock(&mu_);
  return ExpireIdleLocked(now);
}

int64_t SessionTable::ExpireIdleLocked(SteadyTime now) {
  std::vector<std::pair<SteadyTime, SessionId>> idle;
  for (const auto& [id, s] : sessions_) {
    if (IsIdleLocked(s, now)) idle.emplace_back(s.last_used, id);
  }
  // Least recently used first, so that when more expire at once than are
  // remembered, the ids remembered are the most recently used ones.
  std::sort(idle.begin(), idle.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [last_used, id] : idle) {
    EraseLocked(id, &freed_idle_);
    RememberExpiredLocked(id);
  }
  return static_cast<int64_t>(idle.size());
}

bool SessionTable::IsIdleLocked(const Session& s, SteadyTime now) const {
  return options_.idle_timeout > std::chrono::nanoseconds(0) && !s.in_flight &&
         now - s.last_used >= options_.idle_timeout;
}

void SessionTable::EraseLocked(const SessionId& id, int64_t* counter) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  for (const auto& table : it->second.block_tables) blocks_.Free(table).IgnoreError();
  sessions_.erase(it);
  ++*counter;
}

void SessionTable::RememberExpiredLocked(const SessionId& id) {
  const uint64_t serial = next_expired_serial_++;
  expired_[id] = serial;
  expired_order_.emplace_back(id, serial);
  while (static_cast<int64_t>(expired_order_.size()) > options_.remembered_expired) {
    const auto& [old_id, old_serial] = expired_order_.front();
    auto it = expired_.find(old_id);
    if (it != expired_.end() && it->second == old_serial) expired_.erase(it);
    expired_order_.pop_front();
  }
}

void SessionTable::ForgetExpiredLocked(const SessionId& id) { expired_.erase(id); }

absl::Status SessionTable::NotFoundLocked(const SessionId& id) const {
  if (dropped_.contains(id)) {
    return absl::NotFoundError(absl::StrCat(
        "session ", id.ToString(),
        " was dropped by a drain: the server is shutting down, and the session was still open "
        "when its time to end ran out, so its KV cache was freed; start it again with "
        "sequence_start (another replica takes it)"));
  }
  if (expired_.contains(id)) {
    return absl::NotFoundError(
        absl::StrCat("session ", id.ToString(), " expired: it was idle for ",
                     absl::FormatDuration(absl::FromChrono(options_.idle_timeout)),
                     " and its KV cache was freed; start it again with sequence_start"));
  }
  return absl::NotFoundError(
      absl::StrCat("session ", id.ToString(), " not found; a session begins with sequence_start"));
}

int64_t SessionTable::DropForDrain() {
  MutexLock lock(&mu_);
  dropped_for_drain_ = true;
  std::vector<SessionId> idle;
  for (const auto& [id, s] : sessions_) {
    if (!s.in_flight) idle.push_back(id);
  }
  for (const SessionId& id : idle) {
    EraseLocked(id, &freed_drain_);
    dropped_.insert(id);
  }
  return static_cast<int64_t>(idle.size());
}

absl::Status SessionTable::CheckOpen(const SessionId& id) const {
  MutexLock lock(&mu_);
  if (sessions_.contains(id)) return absl::OkStatus();
  return NotFoundLocked(id);
}

SessionTableStats SessionTable::Stats() const {
  MutexLock lock(&mu_);
  SessionTableStats stats;
  stats.sessions_open = static_cast<int64_t>(sessions_.size());
  stats.sessions_in_flight = in_flight_;
  stats.blocks_used = blocks_.used_blocks();
  stats.blocks_capacity = blocks_.capacity();
  stats.freed_end = freed_end_;
  stats.freed_idle = freed_idle_;
  stats.freed_reset = freed_reset_;
  stats.freed_drain = freed_drain_;
  stats.rejected_no_blocks = rejected_no_blocks_;
  return stats;
}

void SessionTable::Touch(const SessionId& id, SteadyTime now) {
  MutexLock lock(&mu_);
  const auto it = sessions_.find(id);
  if (it != sessions_.end() && it->second.last_used < now) it->second.last_used = now;
}

bool SessionTable::InFlight(const SessionId& id) const {
  MutexLock lock(&mu_);
  const auto it = sessions_.find(id);
  return it != sessions_.end() && it->second.in_flight;
}

std::optional<SessionInfo> SessionTable::Find(const SessionId& id) const {
  MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return std::nullopt;
  const Session& s = it->second;
  return SessionInfo{s.batch, s.length, s.in_flight, s.last_used, s.block_tables};
}

absl::Status SessionTable::CheckConsistency() const {
  MutexLock lock(&mu_);
  absl::flat_hash_set<KvBlockId> held;
  int64_t in_flight = 0;
  for (const auto& [id, s] : sessions_) {
    const std::string name = absl::StrCat("session ", id.ToString());
    if (static_cast<int64_t>(s.block_tables.size()) != s.batch) {
      return absl::InternalError(absl::StrCat(name, " has ", s.block_tables.size(),
                                              " block tables for ", s.batch, " sequences"));
    }
    if (s.in_flight) ++in_flight;
    const int64_t want = s.in_flight
                             ? BlocksForTokens(s.length + s.step_tokens, options_.block_tokens)
                             : BlocksForTokens(s.length, options_.block_tokens);
    for (const auto& table : s.block_tables) {
      if (static_cast<int64_t>(table.size()) != want) {
        return absl::InternalError(absl::StrCat(name, " holds ", table.size(),
                                                " blocks in a sequence; its length needs ", want));
      }
      for (KvBlockId b : table) {
        if (!blocks_.IsAllocated(b)) {
          return absl::InternalError(absl::StrCat(name, " holds unallocated block ", b));
        }
        if (!held.insert(b).second) {
          return absl::InternalError(absl::StrCat(name, " holds block ", b, " held elsewhere"));
        }
      }
    }
  }
  if (static_cast<int64_t>(held.size()) != blocks_.used_blocks()) {
    return absl::InternalError(absl::StrCat("sessions hold ", held.size(), " blocks but ",
                                            blocks_.used_blocks(), " are allocated"));
  }
  if (in_flight != in_flight_) {
    return absl::InternalError(
        absl::StrCat(in_flight, " sessions in flight but the count says ", in_flight_));
  }
  return absl::OkStatus();
}

}  // namespace layerserve
