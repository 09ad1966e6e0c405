// The batcher with sessions: a session's requests run one at a time and in
// order, other sessions and stateless requests batch with them, and the
// session table sees every step begun, finished or undone. Against the fake
// backend, so only the scheduling is under test (the backends' own tests
// check what they compute). The ThreadSanitizer build runs this file.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fake_backend.h"
#include "server/core/batcher.h"
#include "server/core/sessions.h"

namespace layerserve {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Steps = std::vector<std::pair<std::string, int64_t>>;

constexpr milliseconds kWait(10000);

std::unique_ptr<SessionTable> MakeTable(std::chrono::nanoseconds idle = seconds(0),
                                        int32_t blocks = 64) {
  SessionTableOptions options;
  options.num_blocks = blocks;
  options.block_tokens = 4;
  options.idle_timeout = idle;
  auto table = SessionTable::Create(options);
  EXPECT_TRUE(table.ok()) << table.status();
  return *std::move(table);
}

// A request of session `session` named `name` whose tokens are the bytes of
// `payload` (hidden size 1). It owns a copy of the payload, which its input
// views, for as long as it lives.
std::unique_ptr<InferRequest> SessionRequest(const std::string& name, const std::string& payload,
                                             SessionParams session, Outcome* out) {
  auto owned = std::make_shared<const std::string>(payload);
  auto r = MakeRequest(*owned, static_cast<int64_t>(owned->size()), out);
  r->on_done = [done = std::move(r->on_done), owned](absl::Status s) { done(std::move(s)); };
  r->id = name;
  r->session = std::move(session);
  return r;
}

SessionParams Start(int64_t id) { return {.id = SessionId(id), .start = true}; }
SessionParams Append(int64_t id) { return {.id = SessionId(id)}; }

// Records the last session statistics reported.
class SessionsObserver final : public ServerObserver {
 public:
  void OnSessions(const SessionTableStats& stats) override {
    MutexLock lock(&mu_);
    last_ = stats;
    ++reports_;
  }
  int64_t reports() const {
    MutexLock lock(&mu_);
    return reports_;
  }
  SessionTableStats last() const {
    MutexLock lock(&mu_);
    return last_;
  }

 private:
  mutable Mutex mu_;
  SessionTableStats last_ ABSL_GUARDED_BY(mu_);
  int64_t reports_ ABSL_GUARDED_BY(mu_) = 0;
};

BatcherOptions SessionOptions(SessionTable* table) {
  BatcherOptions options = Options(1024, 0);
  options.sessions = table;
  return options;
}

TEST(BatcherSessionsTest, OneSessionsRequestsRunInOrderNeverTogether) {
  auto table = MakeTable();
  FakeClock clock;
  FakeBackend backend(2);
  SessionsObserver observer;
  BatcherOptions options = SessionOptions(table.get());
  options.policy.max_queue_delay = std::chrono::microseconds(1000);
  Batcher batcher(options, &backend, &observer, &clock);
  // The device is busy, so everything queues until the batching delay passes.
  Outcome plug;
  KeepBusy(batcher, backend, &plug);
  Outcome outs[5];
  std::vector<std::unique_ptr<InferRequest>> requests;
  requests.push_back(SessionRequest("a0", "xxxxx", Start(1), &outs[0]));
  requests.push_back(SessionRequest("b0", "yy", Start(2), &outs[1]));
  requests.push_back(SessionRequest("a1", "x", Append(1), &outs[2]));
  const std::string zzz = "zzz";
  requests.push_back(MakeRequest(zzz, 3, &outs[3]));
  requests.push_back(SessionRequest("a2", "xx", Append(1), &outs[4]));
  requests[3]->id = "stateless";
  for (auto& r : requests) ASSERT_TRUE(batcher.Enqueue(r).ok());
  clock.Advance(std::chrono::microseconds(1000));
  batcher.Wake();
  ASSERT_TRUE(backend.AwaitBatches(2));
  backend.SetOpen(true);
  for (auto& o : outs) {
    ASSERT_TRUE(o.done.WaitFor(kWait));
    EXPECT_TRUE(o.status.ok()) << o.status;
  }
  // After the plug, the first batch takes a0, b0 and the stateless request;
  // a1 waits for a0, and a2 for a1, each in a batch of its own.
  std::vector<Steps> batches = backend.batch_steps();
  ASSERT_GE(batches.size(), 4u);
  Steps a_steps;
  for (const Steps& batch : batches) {
    int a_in_batch = 0;
    for (const auto& [name, position] : batch) {
      if (name[0] == 'a') {
        ++a_in_batch;
        a_steps.emplace_back(name, position);
      }
    }
    EXPECT_LE(a_in_batch, 1);
  }
  EXPECT_EQ(a_steps, (Steps{{"a0", 0}, {"a1", 5}, {"a2", 6}}));
  EXPECT_EQ(batches[0], (Steps{{"plug", -1}}));
  EXPECT_EQ(batches[1], (Steps{{"a0", 0}, {"b0", 0}, {"stateless", -1}}));
  ASSERT_TRUE(table->Find(SessionId(1)).has_value());
  EXPECT_EQ(table->Find(SessionId(1))->length, 8);
  EXPECT_EQ(table->Find(SessionId(2))->length, 2);
  EXPECT_TRUE(table->CheckConsistency().ok());
  EXPECT_GE(observer.reports(), 3);
  EXPECT_EQ(observer.last().sessions_open, 2);
  EXPECT_EQ(observer.last().sessions_in_flight, 0);
  // The plug's reply may still be running on a reply thread: its Outcome
  // must outlive it.
  ASSERT_TRUE(plug.done.WaitFor(std::chrono::milliseconds(10000)));
}

TEST(BatcherSessionsTest, RefusedStepFailsAloneAndLeavesOthersIntact) {
  auto table = MakeTable();
  FakeBackend backend(1);
  backend.SetOpen(false);
  ServerObserver observer;
  Batcher batcher(SessionOptions(table.get()), &backend, &observer, SteadyClock::Get());
  Outcome unknown, wrong_batch, good, opener;
  auto r0 = SessionRequest("open", "xx", Start(7), &opener);
  ASSERT_TRUE(batcher.Enqueue(r0).ok());
  backend.SetOpen(true);
  ASSERT_TRUE(opener.done.WaitFor(kWait));
  ASSERT_TRUE(opener.status.ok()) << opener.status;

  backend.SetOpen(false);
  auto r1 = SessionRequest("unknown", "x", Append(99), &unknown);
  auto r2 = SessionRequest("wrong-batch", "xx", Append(7), &wrong_batch);
  r2->batch = 2;  // the session holds one sequence
  r2->seq_len = 1;
  const std::string abc = "abc";
  auto r3 = MakeRequest(abc, 3, &good);
  ASSERT_TRUE(batcher.Enqueue(r1).ok());
  ASSERT_TRUE(batcher.Enqueue(r2).ok());
  ASSERT_TRUE(batcher.Enqueue(r3).ok());
  backend.SetOpen(true);
  for (Outcome* o : {&unknown, &wrong_batch, &good}) ASSERT_TRUE(o->done.WaitFor(kWait));
  EXPECT_EQ(unknown.status.code(), absl::StatusCode::kNotFound) << unknown.status;
  EXPECT_NE(unknown.status.message().find("99"), std::string::npos) << unknown.status;
  EXPECT_EQ(wrong_batch.status.code(), absl::StatusCode::kInvalidArgument) << wrong_batch.status;
  EXPECT_TRUE(good.status.ok()) << good.status;
  EXPECT_EQ(good.output, "bcd");
  EXPECT_EQ(table->Find(SessionId(7))->length, 2);
  EXPECT_FALSE(table->Find(SessionId(99)).has_value());
  EXPECT_TRUE(table->CheckConsistency().ok());
}

TEST(BatcherSessionsTest, FailedBatchUndoesItsSteps) {
  auto table = MakeTable();
  FakeBackend backend(1);
  ServerObserver observer;
  Batcher batcher(SessionOptions(table.get()), &backend, &observer, SteadyClock::Get());
  Outcome first, failed, retried;
  auto r0 = SessionRequest("first", "xxx", Start(3), &first);
  ASSERT_TRUE(batcher.Enqueue(r0).ok());
  ASSERT_TRUE(first.done.WaitFor(kWait));
  ASSERT_TRUE(first.status.ok());

  backend.SetFailure(absl::InternalError("device fault"));
  auto r1 = SessionRequest("failed", "xx", Append(3), &failed);
  ASSERT_TRUE(batcher.Enqueue(r1).ok());
  ASSERT_TRUE(failed.done.WaitFor(kWait));
  EXPECT_EQ(failed.status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(table->Find(SessionId(3))->length, 3);

  // The retry lands where the failed step would have.
  backend.SetFailure(absl::OkStatus());
  auto r2 = SessionRequest("retried", "xx", Append(3), &retried);
  ASSERT_TRUE(batcher.Enqueue(r2).ok());
  ASSERT_TRUE(retried.done.WaitFor(kWait));
  EXPECT_TRUE(retried.status.ok());
  EXPECT_EQ(backend.batch_steps().back(), (Steps{{"retried", 3}}));
  EXPECT_EQ(table->Find(SessionId(3))->length, 5);
  EXPECT_TRUE(table->CheckConsistency().ok());
}

TEST(BatcherSessionsTest, EndFreesTheSessionAndPositionRollsBack) {
  auto table = MakeTable();
  FakeBackend backend(1);
  SessionsObserver observer;
  Batcher batcher(SessionOptions(table.get()), &backend, &observer, SteadyClock::Get());
  Outcome outs[3];
  auto r0 = SessionRequest("prefill", "xxxxxx", Start(5), &outs[0]);
  ASSERT_TRUE(batcher.Enqueue(r0).ok());
  ASSERT_TRUE(outs[0].done.WaitFor(kWait));
  // Roll back two tokens (say, rejected speculative ones) and append one.
  SessionParams rollback = Append(5);
  rollback.position = 4;
  auto r1 = SessionRequest("rollback", "x", rollback, &outs[1]);
  ASSERT_TRUE(batcher.Enqueue(r1).ok());
  ASSERT_TRUE(outs[1].done.WaitFor(kWait));
  ASSERT_TRUE(outs[1].status.ok()) << outs[1].status;
  EXPECT_EQ(backend.batch_steps().back(), (Steps{{"rollback", 4}}));
  EXPECT_EQ(table->Find(SessionId(5))->length, 5);

  SessionParams end = Append(5);
  end.end = true;
  auto r2 = SessionRequest("end", "x", end, &outs[2]);
  ASSERT_TRUE(batcher.Enqueue(r2).ok());
  ASSERT_TRUE(outs[2].done.WaitFor(kWait));
  ASSERT_TRUE(outs[2].status.ok());
  EXPECT_FALSE(table->Find(SessionId(5)).has_value());
  EXPECT_EQ(table->Stats().freed_end, 1);
  EXPECT_EQ(table->Stats().blocks_used, 0);
  EXPECT_EQ(observer.last().freed_end, 1);
}

// Through the batcher too: with the pool full, a sequence_end step that
// needs a block is refused and its session ended, so its blocks go back.
TEST(BatcherSessionsTest, AnEndStepFromAFullPoolStillEndsItsSession) {
  auto table = MakeTable(seconds(0), /*blocks=*/2);
  FakeBackend backend(1);
  ServerObserver observer;
  Batcher batcher(SessionOptions(table.get()), &backend, &observer, SteadyClock::Get());
  Outcome a, b, end;
  auto ra = SessionRequest("a", "xxxx", Start(1), &a);  // 4 tokens: one block each
  ASSERT_TRUE(batcher.Enqueue(ra).ok());
  ASSERT_TRUE(a.done.WaitFor(kWait));
  auto rb = SessionRequest("b", "yyyy", Start(2), &b);
  ASSERT_TRUE(batcher.Enqueue(rb).ok());
  ASSERT_TRUE(b.done.WaitFor(kWait));
  ASSERT_EQ(table->Stats().blocks_used, 2);
  SessionParams last = Append(1);
  last.end = true;
  auto rend = SessionRequest("end", "z", last, &end);  // a 5th token needs a new block
  ASSERT_TRUE(batcher.Enqueue(rend).ok());
  ASSERT_TRUE(end.done.WaitFor(kWait));
  EXPECT_EQ(end.status.code(), absl::StatusCode::kResourceExhausted) << end.status;
  EXPECT_FALSE(table->Find(SessionId(1)).has_value());
  EXPECT_EQ(table->Stats().blocks_used, 1);
  EXPECT_TRUE(table->CheckConsistency().ok());
}

TEST(BatcherSessionsTest, EnqueueRefusesWhatCannotBeQueued) {
  FakeBackend backend(1);
  backend.SetOpen(false);
  ServerObserver observer;
  {
    // No session table: the backend keeps no KV cache.
    Batcher batcher(Options(1024, 0), &backend, &observer, SteadyClock::Get());
    Outcome out;
    auto r = SessionRequest("s", "x", Start(1), &out);
    const absl::Status status = batcher.Enqueue(r);
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_NE(r, nullptr);  // handed back, on_done not called
  }
  auto table = MakeTable();
  Batcher batcher(SessionOptions(table.get()), &backend, &observer, SteadyClock::Get());
  Outcome first, restart;
  auto r0 = SessionRequest("first", "x", Start(1), &first);
  ASSERT_TRUE(batcher.Enqueue(r0).ok());
  // A start while the session's first request is still queued.
  auto r1 = SessionRequest("restart", "x", Start(1), &restart);
  const absl::Status status = batcher.Enqueue(r1);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_NE(status.message().find("session 1"), std::string::npos) << status;
  backend.SetOpen(true);
  ASSERT_TRUE(first.done.WaitFor(kWait));
  EXPECT_TRUE(first.status.ok());
  // Once it is answered, the session may be reset.
  ASSERT_TRUE(batcher.Enqueue(r1).ok());
  ASSERT_TRUE(restart.done.WaitFor(kWait));
  EXPECT_TRUE(restart.status.ok()) << restart.status;
  EXPECT_EQ(table->Stats().freed_reset, 1);
}

TEST(BatcherSessionsTest, CancelledWhileQueuedLeavesTheSessionUnchanged) {
  auto table = MakeTable();
  FakeBackend backend(1);
  ServerObserver observer;
  Batcher batcher(SessionOptions(table.get()), &backend, &observer, SteadyClock::Get());
  Outcome first, cancelled;
  auto r0 = SessionRequest("first", "xx", Start(4), &first);
  ASSERT_TRUE(batcher.Enqueue(r0).ok());
  ASSERT_TRUE(first.done.WaitFor(kWait));
  backend.SetOpen(false);
  Outcome blocker;
  const std::string b = "b";
  auto rb = MakeRequest(b, 1, &blocker);  // keeps the one slot busy
  ASSERT_TRUE(batcher.Enqueue(rb).ok());
  ASSERT_TRUE(backend.AwaitBatches(2));
  auto r1 = SessionRequest("cancelled", "xxx", Append(4), &cancelled);
  r1->is_cancelled = [] { return true; };
  ASSERT_TRUE(batcher.Enqueue(r1).ok());
  backend.SetOpen(true);
  ASSERT_TRUE(cancelled.done.WaitFor(kWait));
  // Every Outcome must be written before it goes out of scope (before the
  // batcher, which is declared earlier).
  ASSERT_TRUE(blocker.done.WaitFor(kWait));
  EXPECT_EQ(cancelled.status.code(), absl::StatusCode::kCancelled);
  const auto info = table->Find(SessionId(4));
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->length, 2);
  EXPECT_FALSE(info->in_flight);
  EXPECT_TRUE(table->CheckConsistency().ok());
}

TEST(BatcherSessionsTest, IdleSessionsAreSweptAndThenExpired) {
  FakeClock clock;
  auto table = MakeTable(seconds(10));
  FakeBackend backend(1);
  SessionsObserver observer;
  Batcher batcher(SessionOptions(table.get()), &backend, &observer, &clock);
  Outcome first, late;
  auto r0 = SessionRequest("first", "xx", Start(8), &first);
  ASSERT_TRUE(batcher.Enqueue(r0).ok());
  ASSERT_TRUE(first.done.WaitFor(kWait));
  EXPECT_EQ(table->Stats().sessions_open, 1);

  clock.Advance(seconds(11));
  batcher.Wake();
  // The sweep runs on the scheduler thread; wait for its report.
  const auto give_up = std::chrono::steady_clock::now() + kWait;
  while (table->Stats().sessions_open != 0 && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_EQ(table->Stats().sessions_open, 0);
  EXPECT_EQ(table->Stats().freed_idle, 1);

  auto r1 = SessionRequest("late", "x", Append(8), &late);
  ASSERT_TRUE(batcher.Enqueue(r1).ok());
  ASSERT_TRUE(late.done.WaitFor(kWait));
  EXPECT_EQ(late.status.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(late.status.message().find("expired"), std::string::npos) << late.status;
}

TEST(BatcherSessionsTest, ManySessionsUnderConcurrencyStayIndependent) {
  auto table = MakeTable(seconds(0), 4096);
  FakeBackend backend(3);
  ServerObserver observer;
  Batcher batcher(SessionOptions(table.get()), &backend, &observer, SteadyClock::Get());
  constexpr int kSessions = 8;
  constexpr int kSteps = 20;
  std::vector<std::thread> clients;
  std::atomic<int> failures{0};
  for (int s = 0; s < kSessions; ++s) {
    clients.emplace_back([&, s] {
      for (int step = 0; step < kSteps; ++step) {
        Outcome out;
        SessionParams params = step == 0 ? Start(s + 1) : Append(s + 1);
        params.end = step == kSteps - 1;
        const std::string payload(static_cast<size_t>(1 + (s + step) % 3), 'a');
        auto r = SessionRequest("s", payload, params, &out);
        if (!batcher.Enqueue(r).ok() || !out.done.WaitFor(kWait) || !out.status.ok()) {
          ++failures;
          return;
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(table->Stats().sessions_open, 0);
  EXPECT_EQ(table->Stats().freed_end, kSessions);
  EXPECT_EQ(table->Stats().blocks_used, 0);
  EXPECT_TRUE(table->CheckConsistency().ok());
}

TEST(BatcherSessionsTest, LongRequestRunsInPiecesBesideOtherSessionsSteps) {
  auto table = MakeTable();
  FakeClock clock;
  FakeBackend backend(1);
  ServerObserver observer;
  BatcherOptions options = SessionOptions(table.get());
  options.prefill_chunk_tokens = 4;
  options.policy.max_queue_delay = std::chrono::microseconds(1000);
  Batcher batcher(options, &backend, &observer, &clock);
  Outcome opener;
  auto r0 = SessionRequest("b-open", "y", Start(2), &opener);
  ASSERT_TRUE(batcher.Enqueue(r0).ok());
  clock.Advance(std::chrono::microseconds(1000));
  batcher.Wake();
  ASSERT_TRUE(opener.done.WaitFor(kWait));

  // A 10-token prefill of session 1 and a 1-token step of session 2: the
  // prefill runs as pieces of 4, 4 and 2, the step rides with the first.
  // Both are queued behind a plug in the only slot, so they meet in one queue.
  Outcome plug, prefill, step;
  KeepBusy(batcher, backend, &plug);
  SessionParams start = Start(1);
  start.end = true;  // freed after its last piece, not its first
  auto r1 = SessionRequest("a-prefill", "abcdefghij", start, &prefill);
  auto r2 = SessionRequest("b-step", "y", Append(2), &step);
  ASSERT_TRUE(batcher.Enqueue(r1).ok());
  ASSERT_TRUE(batcher.Enqueue(r2).ok());
  backend.SetOpen(true);
  ASSERT_TRUE(prefill.done.WaitFor(kWait));
  ASSERT_TRUE(step.done.WaitFor(kWait));
  EXPECT_TRUE(prefill.status.ok()) << prefill.status;
  EXPECT_EQ(prefill.output, "bcdefghijk");
  std::vector<Steps> batches = backend.batch_steps();
  ASSERT_EQ(batches.size(), 5u);
  EXPECT_EQ(batches[1], (Steps{{"plug", -1}}));
  EXPECT_EQ(batches[2], (Steps{{"a-prefill", 0}, {"b-step", 1}}));
  EXPECT_EQ(batches[3], (Steps{{"a-prefill", 4}}));
  EXPECT_EQ(batches[4], (Steps{{"a-prefill", 8}}));
  EXPECT_EQ(backend.batch_tokens()[2], 5);
  EXPECT_EQ(backend.batch_tokens()[4], 2);
  EXPECT_FALSE(table->Find(SessionId(1)).has_value());  // ended with its last piece
  EXPECT_EQ(table->Stats().freed_end, 1);
  EXPECT_TRUE(table->CheckConsistency().ok());
  // The plug's reply may still be running on a reply thread: its Outcome
  // must outlive it.
  ASSERT_TRUE(plug.done.WaitFor(std::chrono::milliseconds(10000)));
}

TEST(BatcherSessionsTest, FailedPieceRollsTheSessionBackToWhereTheRequestBegan) {
  auto table = MakeTable();
  FakeBackend backend(1);
  ServerObserver observer;
  BatcherOptions options = SessionOptions(table.get());
  options.prefill_chunk_tokens = 3;
  Batcher batcher(options, &backend, &observer, SteadyClock::Get());
  Outcome first, long_request;
  auto r0 = SessionRequest("first", "xx", Start(6), &first);
  ASSERT_TRUE(batcher.Enqueue(r0).ok());
  ASSERT_TRUE(first.done.WaitFor(kWait));
  ASSERT_TRUE(first.status.ok());
  // Batch 0 was the first request; batch 1 is the long request's first
  // piece; its second piece (batch 2) fails.
  backend.SetFailureFrom(2, absl::InternalError("device fault"));
  auto r1 = SessionRequest("long", "abcdefgh", Append(6), &long_request);
  ASSERT_TRUE(batcher.Enqueue(r1).ok());
  ASSERT_TRUE(long_request.done.WaitFor(kWait));
  EXPECT_EQ(long_request.status.code(), absl::StatusCode::kInternal);
  const auto info = table->Find(SessionId(6));
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->length, 2);  // as before the request
  EXPECT_EQ(table->Stats().blocks_used, 1);
  EXPECT_TRUE(table->CheckConsistency().ok());
}

TEST(BatcherSessionsTest, AQueuedRequestKeepsItsSessionAlive) {
  FakeClock clock;
  auto table = MakeTable(seconds(10));
  FakeBackend backend(1);
  ServerObserver observer;
  Batcher batcher(SessionOptions(table.get()), &backend, &observer, &clock);
  Outcome first, blocker, waiting;
  auto r0 = SessionRequest("first", "xx", Start(9), &first);
  ASSERT_TRUE(batcher.Enqueue(r0).ok());
  ASSERT_TRUE(first.done.WaitFor(kWait));
  // A stateless batch holds the backend's only slot while the session's next
  // step waits behind it for longer than the idle timeout.
  backend.SetOpen(false);
  const std::string b = "b";
  auto rb = MakeRequest(b, 1, &blocker);
  ASSERT_TRUE(batcher.Enqueue(rb).ok());
  ASSERT_TRUE(backend.AwaitBatches(2));
  clock.Advance(seconds(5));
  auto r1 = SessionRequest("waiting", "x", Append(9), &waiting);
  ASSERT_TRUE(batcher.Enqueue(r1).ok());
  for (int i = 0; i < 4; ++i) {  // 20 s of sweeps while it waits
    clock.Advance(seconds(5));
    batcher.Wake();
    std::this_thread::sleep_for(milliseconds(5));
  }
  backend.SetOpen(true);
  ASSERT_TRUE(blocker.done.WaitFor(kWait));
  ASSERT_TRUE(waiting.done.WaitFor(kWait));
  EXPECT_TRUE(waiting.status.ok()) << waiting.status;
  EXPECT_EQ(table->Stats().freed_idle, 0);
  EXPECT_EQ(table->Find(SessionId(9))->length, 3);
}

}  // namespace
}  // namespace layerserve
