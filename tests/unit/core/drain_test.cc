// The end of a drain in the session table (SessionTable::DropForDrain) and
// the draining server's admission rule (AdmitWhileDraining): sessions idle
// at the drop and those with a step running are freed and counted under
// freed_drain, later steps naming them are NOT_FOUND saying so, no session
// opens any more, and a draining server takes only the steps of sessions
// still open.
#include "server/core/drain.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "server/core/sessions.h"

namespace layerserve {
namespace {

const SteadyTime kT0 = SteadyTime{} + std::chrono::seconds(1000);

std::unique_ptr<SessionTable> MakeTable() {
  SessionTableOptions o;
  o.num_blocks = 64;
  o.block_tokens = 4;
  o.max_sessions = 8;
  absl::StatusOr<std::unique_ptr<SessionTable>> t = SessionTable::Create(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

SessionStepRequest Req(SessionId id, bool start, int64_t tokens = 2) {
  return SessionStepRequest{.id = std::move(id), .start = start, .batch = 1, .tokens = tokens};
}

void Open(SessionTable& t, const SessionId& id) {
  ASSERT_TRUE(t.BeginStep(Req(id, true), kT0).ok());
  ASSERT_TRUE(t.FinishStep(id, /*ok=*/true, /*end=*/false, kT0).ok());
}

SessionParams Params(SessionId id, bool start = false) {
  SessionParams p;
  p.id = std::move(id);
  p.start = start;
  return p;
}

TEST(DropForDrainTest, FreesIdleSessionsAndSaysSoToTheirNextStep) {
  std::unique_ptr<SessionTable> t = MakeTable();
  Open(*t, SessionId(7));
  Open(*t, SessionId("chat-1"));
  EXPECT_EQ(t->DropForDrain(), 2);
  const SessionTableStats st = t->Stats();
  EXPECT_EQ(st.sessions_open, 0);
  EXPECT_EQ(st.blocks_used, 0);
  EXPECT_EQ(st.freed_drain, 2);
  EXPECT_EQ(st.freed_end, 0);
  for (const SessionId& id : {SessionId(7), SessionId("chat-1")}) {
    absl::StatusOr<SessionStep> step = t->BeginStep(Req(id, false), kT0);
    ASSERT_EQ(step.status().code(), absl::StatusCode::kNotFound) << step.status();
    EXPECT_TRUE(absl::StrContains(step.status().message(),
                                  "session " + id.ToString() + " was dropped by a drain"))
        << step.status();
    EXPECT_EQ(t->CheckOpen(id).message(), step.status().message());
  }
  // An id never opened is still just unknown.
  EXPECT_TRUE(absl::StrContains(t->CheckOpen(SessionId(8)).message(), "not found"));
  EXPECT_TRUE(t->CheckConsistency().ok());
}

TEST(DropForDrainTest, ASessionWithAStepRunningIsDroppedWhenTheStepFinishes) {
  std::unique_ptr<SessionTable> t = MakeTable();
  Open(*t, SessionId(1));
  Open(*t, SessionId(2));
  ASSERT_TRUE(t->BeginStep(Req(SessionId(1), false), kT0).ok());  // in flight
  ASSERT_TRUE(t->BeginStep(Req(SessionId(2), false), kT0).ok());  // in flight, ends
  EXPECT_EQ(t->DropForDrain(), 0);
  EXPECT_TRUE(t->CheckOpen(SessionId(1)).ok());
  ASSERT_TRUE(t->FinishStep(SessionId(1), /*ok=*/true, /*end=*/false, kT0).ok());
  ASSERT_TRUE(t->FinishStep(SessionId(2), /*ok=*/true, /*end=*/true, kT0).ok());
  const SessionTableStats st = t->Stats();
  EXPECT_EQ(st.sessions_open, 0);
  EXPECT_EQ(st.freed_drain, 1);  // session 2 ended as its client asked
  EXPECT_EQ(st.freed_end, 1);
  EXPECT_EQ(t->CheckOpen(SessionId(1)).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(t->CheckOpen(SessionId(1)).message(), "dropped by a drain"));
  EXPECT_TRUE(absl::StrContains(t->CheckOpen(SessionId(2)).message(), "not found"));
  EXPECT_TRUE(t->CheckConsistency().ok());
}

TEST(DropForDrainTest, NoSessionOpensAfterwards) {
  std::unique_ptr<SessionTable> t = MakeTable();
  Open(*t, SessionId(3));
  t->DropForDrain();
  for (const SessionId& id : {SessionId(3), SessionId(4)}) {
    absl::StatusOr<SessionStep> step = t->BeginStep(Req(id, true), kT0);
    EXPECT_EQ(step.status().code(), absl::StatusCode::kUnavailable) << step.status();
    EXPECT_TRUE(absl::StrContains(step.status().message(), "draining")) << step.status();
  }
  EXPECT_EQ(t->DropForDrain(), 0);  // idempotent
  EXPECT_EQ(t->Stats().freed_drain, 1);
}

TEST(AdmitWhileDrainingTest, OnlyStepsOfOpenSessionsGetIn) {
  std::unique_ptr<SessionTable> t = MakeTable();
  Open(*t, SessionId(5));
  EXPECT_TRUE(AdmitWhileDraining(Params(SessionId(5)), t.get()).ok());

  const absl::Status stateless = AdmitWhileDraining(std::nullopt, t.get());
  EXPECT_EQ(stateless.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(stateless.message(), "the server is shutting down");

  // A start is refused even for an open session (a reset is a new session).
  for (const SessionId& id : {SessionId(5), SessionId(6)}) {
    const absl::Status start = AdmitWhileDraining(Params(id, /*start=*/true), t.get());
    EXPECT_EQ(start.code(), absl::StatusCode::kUnavailable);
    EXPECT_TRUE(absl::StrContains(start.message(), "opens no new session; start session " +
                                                       id.ToString() + " on another replica"))
        << start;
  }
  const absl::Status unknown = AdmitWhileDraining(Params(SessionId(6)), t.get());
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);

  t->DropForDrain();
  const absl::Status dropped = AdmitWhileDraining(Params(SessionId(5)), t.get());
  EXPECT_EQ(dropped.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(dropped.message(), "session 5 was dropped by a drain")) << dropped;
}

TEST(AdmitWhileDrainingTest, WithoutASessionTableNothingGetsIn) {
  EXPECT_EQ(AdmitWhileDraining(Params(SessionId(1)), nullptr).code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace layerserve
