// The session table: the life of a session (start, append, rollback, reset,
// end), every error with its message, failed steps, idle expiry on an injected
// clock, a seeded random walk against a plain model of the expected state,
// and threads stepping distinct sessions at once (run under ThreadSanitizer).
#include "server/core/sessions.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace layerserve {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Tables = std::vector<std::vector<KvBlockId>>;

const SteadyTime kT0 = SteadyTime{} + seconds(1000);

SessionTableOptions Options(int32_t blocks, int64_t block_tokens) {
  SessionTableOptions o;
  o.num_blocks = blocks;
  o.block_tokens = block_tokens;
  o.max_sessions = 8;
  return o;
}

std::unique_ptr<SessionTable> MakeTable(const SessionTableOptions& o) {
  absl::StatusOr<std::unique_ptr<SessionTable>> t = SessionTable::Create(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

SessionStepRequest Req(SessionId id, bool start, int64_t batch, int64_t tokens,
                       std::optional<int64_t> position = std::nullopt) {
  return SessionStepRequest{std::move(id), start, batch, tokens, position};
}

// Begins and finishes one step successfully.
void Step(SessionTable& t, const SessionStepRequest& r, SteadyTime now, bool end = false) {
  absl::StatusOr<SessionStep> s = t.BeginStep(r, now);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(t.FinishStep(r.id, /*ok=*/true, end, now).ok());
}

Tables Prefix(const Tables& tables, int64_t blocks) {
  Tables out;
  for (const auto& t : tables) out.emplace_back(t.begin(), t.begin() + blocks);
  return out;
}

// ---------------------------------------------------------------------------
// SessionId

TEST(SessionIdTest, IntsAndStringsAreDistinctKeys) {
  EXPECT_EQ(SessionId(7), SessionId(7));
  EXPECT_EQ(SessionId("7"), SessionId(std::string("7")));
  EXPECT_NE(SessionId(7), SessionId("7"));
  EXPECT_NE(SessionId(7), SessionId(8));
  EXPECT_EQ(SessionId(), SessionId(int64_t{0}));
  absl::flat_hash_set<SessionId> set = {SessionId(7), SessionId("7"), SessionId(7)};
  EXPECT_EQ(set.size(), 2u);
  EXPECT_TRUE(set.contains(SessionId("7")));
  EXPECT_FALSE(SessionId(7).is_string());
  EXPECT_EQ(SessionId(-3).int_value(), -3);
  EXPECT_EQ(SessionId("x").string_value(), "x");
}

TEST(SessionIdTest, PrintsBoundedAndEscaped) {
  EXPECT_EQ(SessionId(42).ToString(), "42");
  EXPECT_EQ(SessionId(-9223372036854775807 - 1).ToString(), "-9223372036854775808");
  EXPECT_EQ(SessionId("user-7").ToString(), "\"user-7\"");
  EXPECT_EQ(SessionId(std::string("a\"b\n\x01", 5)).ToString(), "\"a\\\"b\\n\\x01\"");
  EXPECT_EQ(SessionId("").ToString(), "\"\"");

  const std::string exactly(SessionId::kMaxPrintedBytes, 'a');
  EXPECT_EQ(SessionId(exactly).ToString(), "\"" + exactly + "\"");
  const std::string long_id(300, 'a');
  EXPECT_EQ(SessionId(long_id).ToString(), "\"" + exactly + "...\" (300 bytes)");
  // Worst case: every byte escapes to four characters.
  const std::string binary(100000, '\xff');
  EXPECT_LE(SessionId(binary).ToString().size(), 4 * SessionId::kMaxPrintedBytes + 32);
}

// ---------------------------------------------------------------------------
// Options

TEST(SessionTableTest, CreateRejectsBadOptions) {
  auto bad = [](auto edit) {
    SessionTableOptions o = Options(8, 4);
    edit(o);
    return SessionTable::Create(o).status();
  };
  EXPECT_EQ(bad([](auto& o) { o.num_blocks = -1; }).message(),
            "KV cache blocks must be >= 0, got -1");
  EXPECT_EQ(bad([](auto& o) { o.block_tokens = 0; }).message(),
            "tokens per KV cache block must be >= 1, got 0");
  EXPECT_EQ(bad([](auto& o) { o.max_sessions = 0; }).message(), "max sessions must be >= 1, got 0");
  EXPECT_EQ(bad([](auto& o) { o.max_session_tokens = -1; }).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](auto& o) { o.idle_timeout = -seconds(1); }).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](auto& o) { o.remembered_expired = -1; }).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(bad([](auto&) {}).ok());
}

// ---------------------------------------------------------------------------
// The life of a session

TEST(SessionTableTest, StartAppendEnd) {
  auto t = MakeTable(Options(16, 4));
  const SessionId id(7);

  absl::StatusOr<SessionStep> s = t->BeginStep(Req(id, true, 2, 5), kT0);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->position, 0);
  EXPECT_EQ(s->tokens, 5);
  EXPECT_EQ(s->block_tokens, 4);
  EXPECT_EQ(s->block_tables, (Tables{{0, 1}, {2, 3}}));  // 5 tokens: 2 blocks per sequence
  EXPECT_TRUE(t->Find(id)->in_flight);
  EXPECT_EQ(t->Find(id)->length, 0);  // not committed until the step finishes
  ASSERT_TRUE(t->FinishStep(id, true, false, kT0).ok());
  EXPECT_EQ(t->Find(id)->length, 5);
  EXPECT_FALSE(t->Find(id)->in_flight);

  // 5 + 3 = 8 tokens still fit the two blocks: nothing new reserved.
  s = t->BeginStep(Req(id, false, 2, 3), kT0);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->position, 5);
  EXPECT_EQ(s->block_tables, (Tables{{0, 1}, {2, 3}}));
  ASSERT_TRUE(t->FinishStep(id, true, false, kT0).ok());

  // The ninth token opens a third block per sequence; an explicit
  // sequence_position equal to the length appends as well.
  s = t->BeginStep(Req(id, false, 2, 1, 8), kT0);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->position, 8);
  EXPECT_EQ(s->block_tables, (Tables{{0, 1, 4}, {2, 3, 5}}));
  EXPECT_EQ(t->Stats().blocks_used, 6);
  ASSERT_TRUE(t->FinishStep(id, true, /*end=*/true, kT0).ok());

  EXPECT_FALSE(t->Find(id).has_value());
  const SessionTableStats st = t->Stats();
  EXPECT_EQ(st.sessions_open, 0);
  EXPECT_EQ(st.blocks_used, 0);
  EXPECT_EQ(st.blocks_capacity, 16);
  EXPECT_EQ(st.freed_end, 1);
  EXPECT_EQ(st.freed_idle, 0);
  EXPECT_EQ(st.freed_reset, 0);
  EXPECT_TRUE(t->CheckConsistency().ok());

  // Ended: a later request without start does not find it.
  EXPECT_EQ(t->BeginStep(Req(id, false, 2, 1), kT0).status().code(), absl::StatusCode::kNotFound);
}

TEST(SessionTableTest, BlockBoundaries) {
  // L = 0, exactly one block, one over, with T = 0 steps that reserve nothing.
  auto t = MakeTable(Options(8, 4));
  const SessionId id("b");
  absl::StatusOr<SessionStep> s = t->BeginStep(Req(id, true, 1, 0), kT0);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->block_tables, (Tables{{}}));
  ASSERT_TRUE(t->FinishStep(id, true, false, kT0).ok());
  EXPECT_EQ(t->Stats().blocks_used, 0);

  s = t->BeginStep(Req(id, false, 1, 4), kT0);  // exactly one block
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->block_tables, (Tables{{0}}));
  ASSERT_TRUE(t->FinishStep(id, true, false, kT0).ok());

  s = t->BeginStep(Req(id, false, 1, 0), kT0);  // T = 0 at a block boundary
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->block_tables, (Tables{{0}}));
  ASSERT_TRUE(t->FinishStep(id, true, false, kT0).ok());

  s = t->BeginStep(Req(id, false, 1, 1), kT0);  // one over
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->position, 4);
  EXPECT_EQ(s->block_tables, (Tables{{0, 1}}));
  ASSERT_TRUE(t->FinishStep(id, true, false, kT0).ok());
  EXPECT_EQ(t->Find(id)->length, 5);
  EXPECT_TRUE(t->CheckConsistency().ok());
}

TEST(SessionTableTest, RollbackTruncatesAndFreesBlocksNoLongerNeeded) {
  auto t = MakeTable(Options(16, 4));
  const SessionId id(1);
  Step(*t, Req(id, true, 2, 10), kT0);  // 3 blocks per sequence
  const Tables before = t->Find(id)->block_tables;
  ASSERT_EQ(before, (Tables{{0, 1, 2}, {3, 4, 5}}));

  // Back to 5 tokens, then 2 new ones at positions 5 and 6: the third block
  // of each sequence is freed, the first two (the kept prefix) stay in place.
  absl::StatusOr<SessionStep> s = t->BeginStep(Req(id, false, 2, 2, 5), kT0);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->position, 5);
  EXPECT_EQ(s->block_tables, Prefix(before, 2));
  EXPECT_EQ(t->Stats().blocks_used, 4);
  ASSERT_TRUE(t->FinishStep(id, true, false, kT0).ok());
  EXPECT_EQ(t->Find(id)->length, 7);

  // Rollback to 0 with no new tokens empties the session but keeps it open.
  Step(*t, Req(id, false, 2, 0, 0), kT0);
  EXPECT_EQ(t->Find(id)->length, 0);
  EXPECT_EQ(t->Find(id)->block_tables, (Tables{{}, {}}));
  EXPECT_EQ(t->Stats().blocks_used, 0);
  EXPECT_EQ(t->Stats().sessions_open, 1);
  EXPECT_TRUE(t->CheckConsistency().ok());
}

TEST(SessionTableTest, TruncateFreesTheBlocksPastTheLength) {
  auto t = MakeTable(Options(16, 4));
  const SessionId id(3);
  Step(*t, Req(id, true, 2, 10), kT0);  // 3 blocks per sequence
  ASSERT_TRUE(t->Truncate(id, 4).ok());
  EXPECT_EQ(t->Find(id)->length, 4);
  EXPECT_EQ(t->Find(id)->block_tables, (Tables{{0}, {3}}));
  EXPECT_EQ(t->Stats().blocks_used, 2);
  EXPECT_TRUE(t->Truncate(id, 9).ok());  // not longer: nothing changes
  EXPECT_EQ(t->Find(id)->length, 4);
  EXPECT_EQ(t->Truncate(id, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->Truncate(SessionId(99), 0).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(t->BeginStep(Req(id, false, 2, 1), kT0).ok());
  EXPECT_EQ(t->Truncate(id, 0).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(t->FinishStep(id, true, false, kT0).ok());
  EXPECT_TRUE(t->CheckConsistency().ok());
}

TEST(SessionTableTest, RollbackWithinTheLastBlockKeepsEveryBlock) {
  auto t = MakeTable(Options(16, 4));
  const SessionId id(1);
  Step(*t, Req(id, true, 1, 7), kT0);  // 2 blocks
  absl::StatusOr<SessionStep> s = t->BeginStep(Req(id, false, 1, 1, 6), kT0);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->position, 6);
  EXPECT_EQ(s->block_tables, (Tables{{0, 1}}));
  ASSERT_TRUE(t->FinishStep(id, true, false, kT0).ok());
  EXPECT_EQ(t->Find(id)->length, 7);
}

TEST(SessionTableTest, StartResetsAnExistingSession) {
  auto t = MakeTable(Options(16, 4));
  const SessionId id("s");
  Step(*t, Req(id, true, 2, 8), kT0);
  EXPECT_EQ(t->Stats().blocks_used, 4);

  // A new start may change B; the old blocks are freed first, so they are
  // available to the new session.
  absl::StatusOr<SessionStep> s = t->BeginStep(Req(id, true, 3, 1), kT0);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->position, 0);
  EXPECT_EQ(s->block_tables.size(), 3u);
  EXPECT_EQ(t->Stats().blocks_used, 3);
  EXPECT_EQ(t->Stats().freed_reset, 1);
  EXPECT_EQ(t->Stats().sessions_open, 1);
  ASSERT_TRUE(t->FinishStep(id, true, false, kT0).ok());
  EXPECT_EQ(t->Find(id)->batch, 3);
  EXPECT_EQ(t->Find(id)->length, 1);
  // start with sequence_position 0 is an explicit "from the beginning".
  ASSERT_TRUE(t->BeginStep(Req(id, true, 3, 1, 0), kT0).ok());
  EXPECT_TRUE(t->CheckConsistency().ok());
}

TEST(SessionTableTest, SessionsAreIndependent) {
  auto t = MakeTable(Options(16, 4));
  Step(*t, Req(SessionId(1), true, 1, 4), kT0);
  Step(*t, Req(SessionId("1"), true, 2, 4), kT0);
  EXPECT_EQ(t->Find(SessionId(1))->block_tables, (Tables{{0}}));
  EXPECT_EQ(t->Find(SessionId("1"))->block_tables, (Tables{{1}, {2}}));
  Step(*t, Req(SessionId(1), false, 1, 0), kT0, /*end=*/true);
  EXPECT_EQ(t->Find(SessionId("1"))->length, 4);
  EXPECT_EQ(t->Stats().blocks_used, 2);
}

// ---------------------------------------------------------------------------
// Errors: each leaves the table as it was and names the session and numbers.

class SessionErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SessionTableOptions o = Options(9, 4);
    o.max_sessions = 3;
    o.max_session_tokens = 40;
    t_ = MakeTable(o);
    Step(*t_, Req(id_, true, 2, 6), kT0);  // 2 blocks per sequence: 4 used, 5 free
    before_ = *t_->Find(id_);
    stats_before_ = t_->Stats();
  }
  void ExpectUnchanged() {
    const std::optional<SessionInfo> now = t_->Find(id_);
    ASSERT_TRUE(now.has_value());
    EXPECT_EQ(now->batch, before_.batch);
    EXPECT_EQ(now->length, before_.length);
    EXPECT_EQ(now->in_flight, before_.in_flight);
    EXPECT_EQ(now->last_used, before_.last_used);
    EXPECT_EQ(now->block_tables, before_.block_tables);
    const SessionTableStats st = t_->Stats();
    EXPECT_EQ(st.sessions_open, stats_before_.sessions_open);
    EXPECT_EQ(st.blocks_used, stats_before_.blocks_used);
    EXPECT_TRUE(t_->CheckConsistency().ok());
  }
  absl::Status Begin(const SessionStepRequest& r) {
    return t_->BeginStep(r, kT0 + seconds(1)).status();
  }

  const SessionId id_{"chat-1"};
  std::unique_ptr<SessionTable> t_;
  SessionInfo before_;
  SessionTableStats stats_before_;
};

TEST_F(SessionErrorTest, BadArguments) {
  absl::Status s = Begin(Req(id_, false, 0, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "session \"chat-1\": batch size 0 is not >= 1");
  s = Begin(Req(id_, false, 2, -1));
  EXPECT_EQ(s.message(), "session \"chat-1\": token count -1 is negative");
  s = Begin(Req(id_, false, 2, 1, -1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "session \"chat-1\": sequence_position -1 is negative");
  // More sequences than the pool has blocks, even with no tokens to add.
  s = Begin(Req(SessionId(2), true, 10, 0));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "session 2: 10 sequences are more than the KV cache's 9 blocks");
  EXPECT_EQ(Begin(Req(SessionId(2), true, std::numeric_limits<int64_t>::max(), 0)).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(t_->Find(SessionId(2)).has_value());
  ExpectUnchanged();
}

TEST_F(SessionErrorTest, UnknownSession) {
  const absl::Status s = Begin(Req(SessionId(99), false, 1, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "session 99 not found; a session begins with sequence_start");
  ExpectUnchanged();
}

TEST_F(SessionErrorTest, BatchDiffersFromTheSessions) {
  const absl::Status s = Begin(Req(id_, false, 3, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "session \"chat-1\" holds 2 sequences but the request has 3 (the batch size is fixed "
            "by the request with sequence_start)");
  ExpectUnchanged();
}

TEST_F(SessionErrorTest, PositionPastTheLength) {
  absl::Status s = Begin(Req(id_, false, 2, 1, 7));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "session \"chat-1\": sequence_position 7 is past the session's length 6");
  s = Begin(Req(id_, true, 2, 1, 3));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "session \"chat-1\": sequence_position 3 on a sequence_start request (a new session "
            "has length 0)");
  ExpectUnchanged();
}

TEST_F(SessionErrorTest, RequestAlreadyInFlight) {
  ASSERT_TRUE(t_->BeginStep(Req(id_, false, 2, 1), kT0).ok());
  before_ = *t_->Find(id_);
  stats_before_ = t_->Stats();
  for (bool start : {false, true}) {
    const absl::Status s = Begin(Req(id_, start, 2, 1));
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(s.message(),
              "session \"chat-1\" already has a request in flight; a session runs one request at "
              "a time, so send the next after the previous one's reply");
  }
  ExpectUnchanged();
  ASSERT_TRUE(t_->FinishStep(id_, true, false, kT0).ok());
  EXPECT_TRUE(Begin(Req(id_, false, 2, 1)).ok());
}

// A full pool never keeps a session its client wants to end: a
// sequence_end step that finds no blocks is refused, uncomputed, and still
// ends the session, giving its blocks back (issue 40, finding 4). Without
// sequence_end the same step leaves the session as it was.
TEST_F(SessionErrorTest, AnEndStepWithNoBlocksStillEndsTheSession) {
  // Fill the pool: session 2 takes the 5 free blocks (1 x 20 tokens).
  Step(*t_, Req(SessionId(2), true, 1, 20), kT0);
  ASSERT_EQ(t_->Stats().blocks_used, 9);
  SessionStepRequest step = Req(id_, false, 2, 4);  // 6 -> 10 tokens: 1 more block each
  absl::Status s = Begin(step);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "session \"chat-1\": out of KV cache blocks: 2 needed (2 sequences x 1 blocks), 0 of 9 "
            "free");
  EXPECT_TRUE(t_->Find(id_).has_value());
  step.end = true;
  s = Begin(step);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "session \"chat-1\": out of KV cache blocks: 2 needed (2 sequences x 1 blocks), 0 of 9 "
            "free; the step was not computed, and the session is ended as sequence_end asked");
  EXPECT_FALSE(t_->Find(id_).has_value());
  EXPECT_EQ(t_->Stats().blocks_used, 5);
  EXPECT_EQ(t_->Stats().freed_end, stats_before_.freed_end + 1);
  EXPECT_TRUE(t_->CheckConsistency().ok());
  // An end step for a session that does not exist is NOT_FOUND, as any.
  EXPECT_EQ(Begin(step).code(), absl::StatusCode::kNotFound);
}

// The same for an end step past --max-session-tokens: the client can always
// end its own session.
TEST_F(SessionErrorTest, AnEndStepPastTheTokenLimitStillEndsTheSession) {
  SessionStepRequest step = Req(id_, false, 2, 15);  // 2 x (6 + 15) = 42 > 40
  step.end = true;
  const absl::Status s = Begin(step);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(
      s.message(),
      "session \"chat-1\": 2 sequences x (6 + 15) tokens would exceed the limit of 40 tokens "
      "per session; the step was not computed, and the session is ended as sequence_end asked");
  EXPECT_FALSE(t_->Find(id_).has_value());
  EXPECT_EQ(t_->Stats().freed_end, stats_before_.freed_end + 1);
  EXPECT_TRUE(t_->CheckConsistency().ok());
  // A start step past the limit has no session to end.
  SessionStepRequest start = Req(SessionId(5), true, 3, 14);
  start.end = true;
  EXPECT_EQ(Begin(start).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(t_->Find(SessionId(5)).has_value());
}

TEST_F(SessionErrorTest, OverMaxSessionTokens) {
  // 2 x (6 + 15) = 42 > 40.
  const absl::Status s = Begin(Req(id_, false, 2, 15));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "session \"chat-1\": 2 sequences x (6 + 15) tokens would exceed the limit of 40 tokens "
            "per session");
  EXPECT_EQ(Begin(Req(SessionId(5), true, 3, 14)).message(),
            "session 5: 3 sequences x (0 + 14) tokens would exceed the limit of 40 tokens per "
            "session");
  // A token count that would overflow is refused the same way.
  EXPECT_EQ(Begin(Req(id_, false, 2, std::numeric_limits<int64_t>::max())).code(),
            absl::StatusCode::kResourceExhausted);
  ExpectUnchanged();
  // A rollback makes room: 2 x (0 + 15) = 30 tokens in 2 x 4 blocks.
  EXPECT_TRUE(Begin(Req(id_, false, 2, 15, 0)).ok());
}

TEST_F(SessionErrorTest, OutOfKvBlocks) {
  // 5 of 9 blocks free; a new session of 3 x 9 tokens needs 3 x 3 = 9.
  absl::Status s = Begin(Req(SessionId(2), true, 3, 9));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "session 2: out of KV cache blocks: 9 needed (3 sequences x 3 blocks), 5 of 9 free");
  EXPECT_FALSE(t_->Find(SessionId(2)).has_value());
  // chat-1 from 6 to 18 tokens: 5 blocks per sequence, 2 x 3 = 6 more.
  s = Begin(Req(id_, false, 2, 12));
  EXPECT_EQ(
      s.message(),
      "session \"chat-1\": out of KV cache blocks: 6 needed (2 sequences x 3 blocks), 5 of 9 free");
  ExpectUnchanged();
  // A rollback's freed blocks count as free: back to 2 tokens (1 block per
  // sequence) gives back 2; then 2 + 18 = 20 tokens need 5 - 1 = 4 more per
  // sequence, 8 in all, with 7 available.
  s = Begin(Req(id_, false, 2, 18, 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "session \"chat-1\": out of KV cache blocks: 8 needed (2 sequences x 4 blocks), 7 of 9 "
            "free (2 of them this request's to give back)");
  ExpectUnchanged();
  // From 6 to 16 tokens needs 2 x 2 = 4: fits, and a failed step gives them back.
  s = Begin(Req(id_, false, 2, 10));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(t_->Stats().blocks_used, 8);
  ASSERT_TRUE(t_->FinishStep(id_, false, false, kT0 + seconds(1)).ok());
  before_.last_used = kT0 + seconds(1);
  ExpectUnchanged();
}

TEST_F(SessionErrorTest, ResetCountsTheOldBlocksAsFree) {
  // 5 free + 4 the reset gives back = 9: a 3 x 12-token start fits exactly.
  ASSERT_TRUE(t_->BeginStep(Req(id_, true, 3, 12), kT0).ok());
  EXPECT_EQ(t_->Stats().blocks_used, 9);
  EXPECT_EQ(t_->Stats().freed_reset, 1);
}

TEST_F(SessionErrorTest, TooManySessions) {
  Step(*t_, Req(SessionId(2), true, 1, 1), kT0);
  Step(*t_, Req(SessionId(3), true, 1, 1), kT0);
  stats_before_ = t_->Stats();
  const absl::Status s = Begin(Req(SessionId(4), true, 1, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "cannot start session 4: 3 sessions are open, the most allowed is 3");
  ExpectUnchanged();
  // Resetting an open session needs no new slot.
  EXPECT_TRUE(Begin(Req(SessionId(3), true, 1, 1)).ok());
}

TEST_F(SessionErrorTest, FinishWithoutAStepInFlight) {
  absl::Status s = t_->FinishStep(id_, true, false, kT0);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "session \"chat-1\" has no step in flight to finish");
  EXPECT_EQ(t_->FinishStep(SessionId(12), true, false, kT0).code(),
            absl::StatusCode::kFailedPrecondition);
  ExpectUnchanged();
}

// ---------------------------------------------------------------------------
// Failed steps

TEST(SessionTableTest, FailedAppendLeavesTheSessionExactlyAsBefore) {
  auto t = MakeTable(Options(16, 4));
  const SessionId id(3);
  Step(*t, Req(id, true, 2, 3), kT0);
  const SessionInfo before = *t->Find(id);
  const SessionTableStats stats_before = t->Stats();

  ASSERT_TRUE(t->BeginStep(Req(id, false, 2, 6), kT0 + seconds(1)).ok());  // +2 blocks each
  EXPECT_EQ(t->Stats().blocks_used, stats_before.blocks_used + 4);
  ASSERT_TRUE(t->FinishStep(id, /*ok=*/false, /*end=*/true, kT0 + seconds(2)).ok());

  const SessionInfo after = *t->Find(id);  // end is ignored on failure
  EXPECT_EQ(after.batch, before.batch);
  EXPECT_EQ(after.length, before.length);
  EXPECT_EQ(after.block_tables, before.block_tables);
  EXPECT_FALSE(after.in_flight);
  EXPECT_EQ(after.last_used, kT0 + seconds(2));
  EXPECT_EQ(t->Stats().blocks_used, stats_before.blocks_used);
  EXPECT_EQ(t->Stats().freed_end, 0);
  EXPECT_TRUE(t->CheckConsistency().ok());

  // The retry gets the same blocks the failed step had.
  absl::StatusOr<SessionStep> s = t->BeginStep(Req(id, false, 2, 6), kT0);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->position, 3);
}

TEST(SessionTableTest, FailedStepKeepsTheRollbackAndTheReset) {
  auto t = MakeTable(Options(16, 4));
  const SessionId id(3);
  Step(*t, Req(id, true, 1, 10), kT0);
  const Tables before = t->Find(id)->block_tables;

  // The rollback to 4 is committed when the step begins (the backend will
  // overwrite positions 4..), so a failed step leaves length 4.
  ASSERT_TRUE(t->BeginStep(Req(id, false, 1, 5, 4), kT0).ok());
  ASSERT_TRUE(t->FinishStep(id, false, false, kT0).ok());
  EXPECT_EQ(t->Find(id)->length, 4);
  EXPECT_EQ(t->Find(id)->block_tables, Prefix(before, 1));
  EXPECT_EQ(t->Stats().blocks_used, 1);

  // A failed start leaves a new, empty session (here: a reset one).
  ASSERT_TRUE(t->BeginStep(Req(id, true, 2, 5), kT0).ok());
  ASSERT_TRUE(t->FinishStep(id, false, false, kT0).ok());
  EXPECT_EQ(t->Find(id)->batch, 2);
  EXPECT_EQ(t->Find(id)->length, 0);
  EXPECT_EQ(t->Stats().blocks_used, 0);
  EXPECT_TRUE(t->CheckConsistency().ok());
}

// ---------------------------------------------------------------------------
// Idle expiry, on an injected clock

class SessionIdleTest : public ::testing::Test {
 protected:
  SessionIdleTest() {
    SessionTableOptions o = Options(16, 4);
    o.idle_timeout = seconds(60);
    o.remembered_expired = 2;
    o.max_sessions = 2;
    t_ = MakeTable(o);
  }
  std::unique_ptr<SessionTable> t_;
};

TEST_F(SessionIdleTest, ExpiresAtTheTimeoutAndNotBefore) {
  Step(*t_, Req(SessionId(1), true, 1, 5), kT0);
  Step(*t_, Req(SessionId(2), true, 1, 5), kT0 + seconds(10));
  EXPECT_EQ(t_->ExpireIdle(kT0 + seconds(60) - std::chrono::nanoseconds(1)), 0);
  EXPECT_EQ(t_->ExpireIdle(kT0 + seconds(60)), 1);
  EXPECT_FALSE(t_->Find(SessionId(1)).has_value());
  EXPECT_TRUE(t_->Find(SessionId(2)).has_value());
  EXPECT_EQ(t_->Stats().freed_idle, 1);
  EXPECT_EQ(t_->Stats().blocks_used, 2);

  const absl::Status s = t_->BeginStep(Req(SessionId(1), false, 1, 1), kT0 + seconds(61)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(),
            "session 1 expired: it was idle for 1m and its KV cache was freed; start it again with "
            "sequence_start");
  EXPECT_TRUE(t_->CheckConsistency().ok());
}

TEST_F(SessionIdleTest, UseRestartsTheIdleTime) {
  Step(*t_, Req(SessionId(1), true, 1, 1), kT0);
  Step(*t_, Req(SessionId(1), false, 1, 1), kT0 + seconds(50));
  EXPECT_EQ(t_->ExpireIdle(kT0 + seconds(100)), 0);
  EXPECT_EQ(t_->ExpireIdle(kT0 + seconds(110)), 1);
}

TEST_F(SessionIdleTest, InFlightSessionsNeverExpire) {
  ASSERT_TRUE(t_->BeginStep(Req(SessionId(1), true, 1, 1), kT0).ok());
  EXPECT_EQ(t_->ExpireIdle(kT0 + seconds(3600)), 0);
  // The step's finish is its last use.
  ASSERT_TRUE(t_->FinishStep(SessionId(1), true, false, kT0 + seconds(3600)).ok());
  EXPECT_EQ(t_->ExpireIdle(kT0 + seconds(3659)), 0);
  EXPECT_EQ(t_->ExpireIdle(kT0 + seconds(3660)), 1);
}

TEST_F(SessionIdleTest, ARequestFindsItsSessionExpiredWithoutASweep) {
  Step(*t_, Req(SessionId(1), true, 1, 1), kT0);
  const absl::Status s = t_->BeginStep(Req(SessionId(1), false, 1, 1), kT0 + seconds(60)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("expired"), std::string_view::npos) << s;
  EXPECT_EQ(t_->Stats().freed_idle, 1);
  EXPECT_EQ(t_->Stats().blocks_used, 0);
}

TEST_F(SessionIdleTest, StartingAgainForgetsTheExpiry) {
  Step(*t_, Req(SessionId(1), true, 1, 1), kT0);
  ASSERT_EQ(t_->ExpireIdle(kT0 + seconds(60)), 1);
  Step(*t_, Req(SessionId(1), true, 1, 1), kT0 + seconds(61), /*end=*/true);
  const absl::Status s = t_->BeginStep(Req(SessionId(1), false, 1, 1), kT0 + seconds(62)).status();
  EXPECT_EQ(s.message(), "session 1 not found; a session begins with sequence_start");
}

TEST_F(SessionIdleTest, RemembersABoundedNumberOfExpiredIds) {
  // One sweep expires 1 and 2, the least recently used first.
  Step(*t_, Req(SessionId(1), true, 1, 1), kT0);
  Step(*t_, Req(SessionId(2), true, 1, 1), kT0 + seconds(1));
  ASSERT_EQ(t_->ExpireIdle(kT0 + seconds(61)), 2);
  Step(*t_, Req(SessionId(3), true, 1, 1), kT0 + seconds(61));
  ASSERT_EQ(t_->ExpireIdle(kT0 + seconds(121)), 1);
  // Two remembered: 2 and 3; 1, the oldest, is forgotten.
  const SteadyTime later = kT0 + seconds(122);
  EXPECT_NE(
      t_->BeginStep(Req(SessionId(1), false, 1, 1), later).status().message().find("not found"),
      std::string_view::npos);
  for (int64_t i : {2, 3}) {
    EXPECT_NE(
        t_->BeginStep(Req(SessionId(i), false, 1, 1), later).status().message().find("expired"),
        std::string_view::npos)
        << i;
  }
}

TEST_F(SessionIdleTest, IdleSessionsMakeRoomForNewOnes) {
  Step(*t_, Req(SessionId(1), true, 1, 1), kT0);
  Step(*t_, Req(SessionId(2), true, 1, 1), kT0 + seconds(30));
  EXPECT_EQ(t_->BeginStep(Req(SessionId(3), true, 1, 1), kT0 + seconds(59)).status().code(),
            absl::StatusCode::kResourceExhausted);
  // At 60 s session 1 is idle: starting 3 expires it to make room.
  EXPECT_TRUE(t_->BeginStep(Req(SessionId(3), true, 1, 1), kT0 + seconds(60)).ok());
  EXPECT_FALSE(t_->Find(SessionId(1)).has_value());
  EXPECT_TRUE(t_->Find(SessionId(2)).has_value());
  EXPECT_EQ(t_->Stats().freed_idle, 1);
}

TEST(SessionTableTest, ZeroIdleTimeoutNeverExpires) {
  auto t = MakeTable(Options(4, 4));
  Step(*t, Req(SessionId(1), true, 1, 1), kT0);
  EXPECT_EQ(t->ExpireIdle(kT0 + std::chrono::hours(24 * 365)), 0);
  EXPECT_TRUE(
      t->BeginStep(Req(SessionId(1), false, 1, 1), kT0 + std::chrono::hours(24 * 365)).ok());
}

// ---------------------------------------------------------------------------
// A seeded random walk against a plain model of what the table should hold.

struct ModelSession {
  int64_t batch = 0;
  int64_t length = 0;
  bool in_flight = false;
  int64_t step_tokens = 0;
  SteadyTime last_used{};
  Tables tables;  // as last observed: the kept prefix must never move
};

class Model {
 public:
  explicit Model(const SessionTableOptions& o) : o_(o) {}

  // The code BeginStep should return, applying the effects to the model.
  absl::StatusCode Begin(const SessionStepRequest& r, SteadyTime now, int64_t* position) {
    if (r.batch < 1 || r.tokens < 0 || (r.position && *r.position < 0)) {
      return absl::StatusCode::kInvalidArgument;
    }
    auto it = sessions_.find(r.id.ToString());
    if (it != sessions_.end() && Idle(it->second, now)) {
      Expire(it->first);
      it = sessions_.end();
    }
    if (it != sessions_.end() && it->second.in_flight) return absl::StatusCode::kFailedPrecondition;
    if (!r.start) {
      if (it == sessions_.end()) return absl::StatusCode::kNotFound;
      if (it->second.batch != r.batch) return absl::StatusCode::kInvalidArgument;
    }
    const int64_t length = r.start ? 0 : it->second.length;
    const int64_t pos = r.position.value_or(length);
    if (pos > length) return absl::StatusCode::kFailedPrecondition;
    if (o_.max_session_tokens > 0 && r.batch * (pos + r.tokens) > o_.max_session_tokens) {
      return absl::StatusCode::kResourceExhausted;
    }
    if (it == sessions_.end() && static_cast<int64_t>(sessions_.size()) >= o_.max_sessions) {
      std::vector<std::string> idle;
      for (auto& [k, s] : sessions_) {
        if (Idle(s, now)) idle.push_back(k);
      }
      for (const auto& k : idle) Expire(k);
      if (static_cast<int64_t>(sessions_.size()) >= o_.max_sessions) {
        return absl::StatusCode::kResourceExhausted;
      }
    }
    const int64_t held_after = BlocksUsed() - (it == sessions_.end() ? 0 : Held(it->second)) +
                               r.batch * Blocks(pos + r.tokens);
    if (held_after > o_.num_blocks) return absl::StatusCode::kResourceExhausted;
    if (it == sessions_.end()) expired_.erase(r.id.ToString());
    ModelSession& s = sessions_[r.id.ToString()];
    if (it != sessions_.end() && r.start) ++freed_reset;
    if (r.start) s.tables.assign(static_cast<size_t>(r.batch), {});
    s.batch = r.batch;
    s.length = pos;
    for (auto& t : s.tables)
      t.resize(static_cast<size_t>(std::min<int64_t>(t.size(), Blocks(pos))));
    s.in_flight = true;
    s.step_tokens = r.tokens;
    s.last_used = now;
    *position = pos;
    return absl::StatusCode::kOk;
  }

  // Whether FinishStep should succeed, applying its effects.
  bool Finish(const std::string& key, bool ok, bool end, SteadyTime now) {
    auto it = sessions_.find(key);
    if (it == sessions_.end() || !it->second.in_flight) return false;
    ModelSession& s = it->second;
    s.in_flight = false;
    s.last_used = now;
    if (ok) {
      s.length += s.step_tokens;
      if (end) {
        sessions_.erase(it);
        ++freed_end;
      }
    } else {
      for (auto& t : s.tables) t.resize(static_cast<size_t>(Blocks(s.length)));
    }
    return true;
  }

  int64_t ExpireIdle(SteadyTime now) {
    std::vector<std::string> idle;
    for (auto& [k, s] : sessions_) {
      if (Idle(s, now)) idle.push_back(k);
    }
    for (const auto& k : idle) Expire(k);
    return static_cast<int64_t>(idle.size());
  }

  int64_t BlocksUsed() const {
    int64_t n = 0;
    for (const auto& [k, s] : sessions_) n += Held(s);
    return n;
  }

  std::map<std::string, ModelSession> sessions_;
  absl::flat_hash_set<std::string> expired_;
  int64_t freed_end = 0, freed_idle = 0, freed_reset = 0;

 private:
  int64_t Blocks(int64_t tokens) const { return BlocksForTokens(tokens, o_.block_tokens); }
  int64_t Held(const ModelSession& s) const {
    return s.batch * Blocks(s.length + (s.in_flight ? s.step_tokens : 0));
  }
  bool Idle(const ModelSession& s, SteadyTime now) const {
    return !s.in_flight && now - s.last_used >= o_.idle_timeout;
  }
  void Expire(std::string key) {  // by value: `key` may name the entry it erases
    sessions_.erase(key);
    expired_.insert(key);
    ++freed_idle;
  }

  const SessionTableOptions o_;
};

void RandomWalk(uint32_t seed, int steps) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };

  SessionTableOptions o;
  o.num_blocks = 16;
  o.block_tokens = 4;
  o.max_sessions = 5;
  o.max_session_tokens = 30;
  o.idle_timeout = milliseconds(150);
  o.remembered_expired = 1000;  // more than the walk can expire: the model remembers all
  auto t = MakeTable(o);
  Model model(o);
  const std::vector<SessionId> ids = {SessionId(1),   SessionId(2),
                                      SessionId("1"), SessionId("a"),
                                      SessionId(-5),  SessionId(std::string(100, 'z'))};
  SteadyTime now = kT0;
  int ok_begins = 0, failed_finishes = 0, rollbacks = 0, expired_found = 0;
  std::map<absl::StatusCode, int> begin_codes;
  std::map<std::string, int> exhausted;  // RESOURCE_EXHAUSTED by what ran out

  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE(testing::Message() << "step " << step);
    now += milliseconds(uniform(0, 12));
    const SessionId& id =
        ids[static_cast<size_t>(uniform(0, static_cast<int64_t>(ids.size()) - 1))];
    const std::string key = id.ToString();
    auto ms = model.sessions_.find(key);
    const bool exists = ms != model.sessions_.end();
    const std::optional<SessionInfo> before = t->Find(id);
    const int64_t roll = uniform(0, 99);

    if (roll < 50) {  // begin
      SessionStepRequest r;
      r.id = id;
      r.start = !exists ? chance(0.7) : chance(0.1);
      r.batch = exists && chance(0.9) ? ms->second.batch : uniform(1, 3);
      if (chance(0.01)) r.batch = 0;
      r.tokens = uniform(0, 7);
      const int64_t length = exists ? ms->second.length : 0;
      const int64_t p = uniform(0, 99);
      if (p < 30) {
        r.position = uniform(0, length);
      } else if (p < 38) {
        r.position = length + uniform(1, 3);
      } else if (p < 39) {
        r.position = -1;
      }
      int64_t position = -1;
      const absl::StatusCode want = model.Begin(r, now, &position);
      const absl::StatusOr<SessionStep> got = t->BeginStep(r, now);
      ASSERT_EQ(got.status().code(), want) << got.status();
      ++begin_codes[want];
      if (want == absl::StatusCode::kResourceExhausted) {
        for (const char* what :
             {"out of KV cache blocks", "tokens per session", "sessions are open"}) {
          if (got.status().message().find(what) != std::string_view::npos) ++exhausted[what];
        }
      }
      if (want == absl::StatusCode::kNotFound) {
        const bool expired = model.expired_.contains(key);
        expired_found += expired ? 1 : 0;
        EXPECT_EQ(got.status().message().find("expired") != std::string_view::npos, expired)
            << got.status();
      }
      if (got.ok()) {
        ++ok_begins;
        if (r.position && *r.position < before.value_or(SessionInfo{}).length) ++rollbacks;
        EXPECT_EQ(got->position, position);
        EXPECT_EQ(got->tokens, r.tokens);
        ASSERT_EQ(static_cast<int64_t>(got->block_tables.size()), r.batch);
        ModelSession& m = model.sessions_[key];
        // The blocks holding the kept prefix never move; the rest are new.
        for (size_t i = 0; i < got->block_tables.size(); ++i) {
          const auto& table = got->block_tables[i];
          ASSERT_EQ(static_cast<int64_t>(table.size()),
                    BlocksForTokens(position + r.tokens, o.block_tokens));
          ASSERT_GE(table.size(), m.tables[i].size());
          EXPECT_TRUE(std::equal(m.tables[i].begin(), m.tables[i].end(), table.begin()));
        }
        m.tables = got->block_tables;
      } else if (before.has_value() && t->Find(id).has_value()) {
        // Errors change nothing (an idle session expired on the way is gone).
        const SessionInfo after = *t->Find(id);
        EXPECT_EQ(after.length, before->length);
        EXPECT_EQ(after.block_tables, before->block_tables);
        EXPECT_EQ(after.last_used, before->last_used);
        EXPECT_EQ(after.in_flight, before->in_flight);
      }
    } else if (roll < 92) {  // finish
      const bool ok = chance(0.75);
      const bool end = chance(0.15);
      const bool want = model.Finish(key, ok, end, now);
      const absl::Status got = t->FinishStep(id, ok, end, now);
      ASSERT_EQ(got.ok(), want) << got;
      if (want && !ok) ++failed_finishes;
      if (want && !ok && before.has_value()) {
        // A failed step gives back exactly the blocks it reserved.
        const SessionInfo after = *t->Find(id);
        EXPECT_EQ(after.length, before->length);
        EXPECT_EQ(after.block_tables,
                  Prefix(before->block_tables, BlocksForTokens(before->length, o.block_tokens)));
      }
    } else {  // sweep
      ASSERT_EQ(t->ExpireIdle(now), model.ExpireIdle(now));
    }

    // The whole table against the model.
    ASSERT_TRUE(t->CheckConsistency().ok()) << t->CheckConsistency();
    const SessionTableStats st = t->Stats();
    ASSERT_EQ(st.sessions_open, static_cast<int64_t>(model.sessions_.size()));
    ASSERT_EQ(st.blocks_used, model.BlocksUsed());
    ASSERT_EQ(st.freed_end, model.freed_end);
    ASSERT_EQ(st.freed_idle, model.freed_idle);
    ASSERT_EQ(st.freed_reset, model.freed_reset);
    for (const SessionId& other : ids) {
      const std::optional<SessionInfo> info = t->Find(other);
      auto m = model.sessions_.find(other.ToString());
      ASSERT_EQ(info.has_value(), m != model.sessions_.end()) << other.ToString();
      if (!info) continue;
      ASSERT_EQ(info->batch, m->second.batch);
      ASSERT_EQ(info->length, m->second.length);
      ASSERT_EQ(info->in_flight, m->second.in_flight);
      ASSERT_EQ(info->last_used, m->second.last_used);
      if (!info->in_flight) m->second.tables = info->block_tables;
    }
  }
  // The walk exercised what it is meant to: every outcome of BeginStep, and
  // every way a session goes.
  EXPECT_GT(ok_begins, steps / 10);
  EXPECT_GT(failed_finishes, 0);
  EXPECT_GT(rollbacks, 0);
  EXPECT_GT(expired_found, 0);
  for (absl::StatusCode code :
       {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
        absl::StatusCode::kFailedPrecondition, absl::StatusCode::kResourceExhausted}) {
    EXPECT_GT(begin_codes[code], 0) << absl::StatusCodeToString(code);
  }
  EXPECT_EQ(exhausted.size(), 3u);
  EXPECT_GT(model.freed_idle, 0);
  EXPECT_GT(model.freed_end, 0);
  EXPECT_GT(model.freed_reset, 0);
}

TEST(SessionTableRandomTest, MatchesAModelOfTheExpectedState) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    RandomWalk(seed, 2000);
    if (HasFatalFailure()) return;
  }
}

// ---------------------------------------------------------------------------
// Threads stepping distinct sessions at once (ThreadSanitizer checks the lock).

TEST(SessionTableConcurrencyTest, ThreadsStepDistinctSessions) {
  SessionTableOptions o;
  o.num_blocks = 4 * 2 * 8;  // every thread's session at its longest fits
  o.block_tokens = 4;
  o.max_sessions = 8;
  o.idle_timeout = seconds(1);
  auto t = MakeTable(o);
  constexpr int kThreads = 4;
  constexpr int kSteps = 500;
  std::atomic<int64_t> ended{0};
  std::atomic<bool> stop{false};

  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      std::mt19937 rng(static_cast<uint32_t>(100 + i));
      const SessionId id = i % 2 == 0 ? SessionId(i) : SessionId(absl::StrCat("thread-", i));
      int64_t length = 0;
      bool open = false;
      for (int step = 0; step < kSteps; ++step) {
        SessionStepRequest r;
        r.id = id;
        r.start = !open;
        r.batch = 2;
        r.tokens = std::uniform_int_distribution<int64_t>(1, 4)(rng);
        if (length + r.tokens > 32) r.position = 0;  // roll back rather than outgrow the pool
        const absl::StatusOr<SessionStep> s = t->BeginStep(r, kT0);
        ASSERT_TRUE(s.ok()) << s.status();
        ASSERT_EQ(s->position, r.start ? 0 : r.position.value_or(length));
        const bool ok = rng() % 8 != 0;
        const bool end = ok && rng() % 16 == 0;
        ASSERT_TRUE(t->FinishStep(id, ok, end, kT0).ok());
        if (r.start) length = 0;
        if (r.position) length = *r.position;
        if (ok) length += r.tokens;
        open = !end;
        if (end) {
          length = 0;
          ended.fetch_add(1);
        }
        const std::optional<SessionInfo> info = t->Find(id);
        ASSERT_EQ(info.has_value(), open);
        if (open) ASSERT_EQ(info->length, length);
      }
    });
  }
  // A reader taking stats and sweeping (nothing is idle at kT0) meanwhile.
  std::thread reader([&] {
    while (!stop.load()) {
      const SessionTableStats st = t->Stats();
      EXPECT_LE(st.blocks_used, st.blocks_capacity);
      EXPECT_EQ(t->ExpireIdle(kT0), 0);
      EXPECT_TRUE(t->CheckConsistency().ok());
    }
  });
  for (auto& th : threads) th.join();
  stop.store(true);
  reader.join();

  const SessionTableStats st = t->Stats();
  EXPECT_EQ(st.freed_end, ended.load());
  EXPECT_EQ(st.sessions_in_flight, 0);
  EXPECT_TRUE(t->CheckConsistency().ok());
  // Whatever is left open expires once idle.
  EXPECT_EQ(t->ExpireIdle(kT0 + seconds(1)), st.sessions_open);
  EXPECT_EQ(t->Stats().blocks_used, 0);
}

}  // namespace
}  // namespace layerserve
