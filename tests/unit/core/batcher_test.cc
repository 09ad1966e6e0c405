// The batcher under concurrency, against a fake backend whose completions run
// on their own thread (as the real backends' do). Time-based behaviour uses a
// FakeClock; the ThreadSanitizer build runs this file.
#include "server/core/batcher.h"

#include <gtest/gtest.h>

#include <atomic>
#include <deque>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "fake_backend.h"

namespace layerserve {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

TEST(BatcherTest, AnIdleDeviceRunsARequestAtOnce) {
  FakeClock clock;  // never advanced: the delay never passes
  FakeBackend backend(1);
  ServerObserver observer;
  Batcher batcher(Options(64, 1'000'000), &backend, &observer, &clock);
  const std::string payload = "ab";
  Outcome out;
  auto r = MakeRequest(payload, 2, &out);
  ASSERT_TRUE(batcher.Enqueue(r).ok());
  ASSERT_TRUE(out.done.WaitFor(milliseconds(10000)));
  EXPECT_TRUE(out.status.ok()) << out.status;
  EXPECT_EQ(out.output, "bc");
}

TEST(BatcherTest, WhileBusyAPartialBatchWaitsForTheDelayThenRunsTogether) {
  FakeClock clock;
  FakeBackend backend(2);  // one slot for the plug, one free
  ServerObserver observer;
  Batcher batcher(Options(64, 1000), &backend, &observer, &clock);
  Outcome plug;
  KeepBusy(batcher, backend, &plug);
  const std::string payload = "ab";
  Outcome outs[3];
  for (auto& o : outs) {
    auto r = MakeRequest(payload, 2, &o);
    ASSERT_TRUE(batcher.Enqueue(r).ok());
  }
  clock.Advance(microseconds(999));
  batcher.Wake();
  // Not due yet: no batch may form (a short real wait proves the absence).
  std::this_thread::sleep_for(milliseconds(30));
  EXPECT_EQ(backend.batch_sizes().size(), 1u);
  clock.Advance(microseconds(1));
  batcher.Wake();
  ASSERT_TRUE(backend.AwaitBatches(2));
  backend.SetOpen(true);
  for (auto& o : outs) {
    ASSERT_TRUE(o.done.WaitFor(milliseconds(10000)));
    EXPECT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.output, "bc");
  }
  EXPECT_EQ(backend.batch_sizes(), (std::vector<size_t>{1, 3}));
  EXPECT_EQ(backend.batch_tokens(), (std::vector<int64_t>{1, 6}));
  // The plug's reply may still be running on a reply thread: its Outcome
  // must outlive it.
  ASSERT_TRUE(plug.done.WaitFor(std::chrono::milliseconds(10000)));
}

TEST(BatcherTest, JustInTimeTheNextBatchFormsAsTheRunningOneEnds) {
  FakeClock clock;
  FakeBackend backend(2);
  ServerObserver observer;
  BatcherOptions options = Options(64, 500);
  options.policy.max_device_wait = microseconds(2000);
  options.policy.device_lead = microseconds(100);
  Batcher batcher(options, &backend, &observer, &clock);
  // A first 1-token batch computes for 800 us: the batcher learns it.
  backend.SetOpen(false);
  const std::string payload = "a";
  Outcome first;
  auto r = MakeRequest(payload, 1, &first);
  ASSERT_TRUE(batcher.Enqueue(r).ok());
  ASSERT_TRUE(backend.AwaitBatches(1));
  clock.Advance(microseconds(800));
  backend.SetOpen(true);
  ASSERT_TRUE(first.done.WaitFor(milliseconds(10000)));
  // The next 1-token batch starts now and is predicted to end in 800 us. A
  // request queued meanwhile waits past its 500 us delay, up to 100 us before
  // that end, rather than compute beside it.
  Outcome plug;
  KeepBusy(batcher, backend, &plug);
  Outcome second;
  auto s = MakeRequest(payload, 1, &second);
  ASSERT_TRUE(batcher.Enqueue(s).ok());
  clock.Advance(microseconds(500));
  batcher.Wake();
  std::this_thread::sleep_for(milliseconds(30));
  EXPECT_EQ(backend.batch_sizes().size(), 2u);
  clock.Advance(microseconds(200));
  batcher.Wake();
  ASSERT_TRUE(backend.AwaitBatches(3));
  backend.SetOpen(true);
  ASSERT_TRUE(second.done.WaitFor(milliseconds(10000)));
  EXPECT_TRUE(second.status.ok()) << second.status;
  ASSERT_TRUE(plug.done.WaitFor(milliseconds(10000)));
}

TEST(BatcherTest, FullBatchRunsWithoutWaiting) {
  FakeClock clock;         // never advanced: only fullness can trigger the batch
  FakeBackend backend(2);  // one slot for the plug, one free
  ServerObserver observer;
  Batcher batcher(Options(8, 1'000'000), &backend, &observer, &clock);
  Outcome plug;
  KeepBusy(batcher, backend, &plug);  // busy: the first request alone waits
  const std::string payload(4, 'x');
  Outcome a, b;
  auto ra = MakeRequest(payload, 4, &a);
  auto rb = MakeRequest(payload, 4, &b);
  ASSERT_TRUE(batcher.Enqueue(ra).ok());
  ASSERT_TRUE(batcher.Enqueue(rb).ok());
  ASSERT_TRUE(backend.AwaitBatches(2));
  backend.SetOpen(true);
  // Both are waited for: one batch's replies run on several reply threads.
  ASSERT_TRUE(a.done.WaitFor(milliseconds(10000)));
  ASSERT_TRUE(b.done.WaitFor(milliseconds(10000)));
  EXPECT_TRUE(a.status.ok());
  EXPECT_EQ(backend.batch_sizes(), (std::vector<size_t>{1, 2}));
  // The plug's reply may still be running on a reply thread: its Outcome
  // must outlive it.
  ASSERT_TRUE(plug.done.WaitFor(std::chrono::milliseconds(10000)));
}

TEST(BatcherTest, ARequestRecordsItsWaitForAReplyThread) {
  FakeClock clock;
  FakeBackend backend(1);
  ServerObserver observer;
  BatcherOptions options = Options(2, 1'000'000);  // two 1-token requests fill a batch
  options.reply_threads = 1;                       // the replies run one after the other
  Batcher batcher(options, &backend, &observer, &clock);
  // The plug holds the only slot, so both requests are queued before any
  // batch can form: an idle device would run the first one alone at once.
  Outcome plug;
  KeepBusy(batcher, backend, &plug);
  const std::string payload = "a";
  // The first reply holds the only reply thread while the clock moves 3 ms:
  // the second request waits that long for it, the first not at all.
  Notification first_started, release;
  Outcome a, b;
  double wait_a = -1, wait_b = -1;
  auto ra = MakeRequest(payload, 1, &a);
  auto rb = MakeRequest(payload, 1, &b);
  ra->on_done = [&, raw = ra.get()](absl::Status) {
    wait_a = raw->reply_wait_seconds;
    first_started.Notify();
    release.WaitFor(milliseconds(10000));
    a.done.Notify();
  };
  rb->on_done = [&, raw = rb.get()](absl::Status) {
    wait_b = raw->reply_wait_seconds;
    b.done.Notify();
  };
  ASSERT_TRUE(batcher.Enqueue(ra).ok());
  ASSERT_TRUE(batcher.Enqueue(rb).ok());
  backend.SetOpen(true);
  ASSERT_TRUE(first_started.WaitFor(milliseconds(10000)));
  clock.Advance(microseconds(3000));
  release.Notify();
  ASSERT_TRUE(a.done.WaitFor(milliseconds(10000)));
  ASSERT_TRUE(b.done.WaitFor(milliseconds(10000)));
  ASSERT_TRUE(plug.done.WaitFor(milliseconds(10000)));
  EXPECT_EQ(backend.batch_sizes(), (std::vector<size_t>{1, 2}));
  EXPECT_DOUBLE_EQ(wait_a, 0.0);
  EXPECT_NEAR(wait_b, 0.003, 1e-9);
}

TEST(BatcherTest, RequestsAccumulateWhileTheBackendIsBusy) {
  SteadyClock* clock = SteadyClock::Get();
  FakeBackend backend(1);
  ServerObserver observer;
  Batcher batcher(Options(1024, 0), &backend, &observer, clock);
  backend.SetOpen(false);
  const std::string payload = "p";
  Outcome first;
  auto r0 = MakeRequest(payload, 1, &first);
  ASSERT_TRUE(batcher.Enqueue(r0).ok());
  ASSERT_TRUE(backend.AwaitBatches(1));  // the only slot is now taken
  std::vector<Outcome> rest(10);
  for (auto& o : rest) {
    auto r = MakeRequest(payload, 1, &o);
    ASSERT_TRUE(batcher.Enqueue(r).ok());
  }
  backend.SetOpen(true);
  // Every outcome is waited for before it goes out of scope: replies run on
  // the batcher's reply threads, in no particular order.
  ASSERT_TRUE(first.done.WaitFor(milliseconds(10000)));
  for (auto& o : rest) ASSERT_TRUE(o.done.WaitFor(milliseconds(10000)));
  EXPECT_EQ(backend.batch_sizes(), (std::vector<size_t>{1, 10}));
}

// Replies run on the batcher's reply threads: a slow reply (here one that
// blocks until the next batch has run) holds neither the backend's only slot
// nor the backend's thread.
TEST(BatcherTest, ASlowReplyDoesNotHoldTheBackend) {
  SteadyClock* clock = SteadyClock::Get();
  FakeBackend backend(1);
  ServerObserver observer;
  Batcher batcher(Options(1024, 0), &backend, &observer, clock);
  const std::string payload = "a";  // requests view their input: it must outlive them
  Notification second_done;
  Outcome first;
  auto r0 = MakeRequest(payload, 1, &first);
  r0->on_done = [&first, &second_done](absl::Status s) {
    first.status = s;
    first.output = second_done.WaitFor(milliseconds(10000)) ? "second ran first" : "timed out";
    first.done.Notify();
  };
  ASSERT_TRUE(batcher.Enqueue(r0).ok());
  ASSERT_TRUE(backend.AwaitBatches(1));
  Outcome second;
  auto r1 = MakeRequest(payload, 1, &second);
  ASSERT_TRUE(batcher.Enqueue(r1).ok());
  ASSERT_TRUE(second.done.WaitFor(milliseconds(10000)));
  second_done.Notify();
  ASSERT_TRUE(first.done.WaitFor(milliseconds(10000)));
  EXPECT_EQ(first.output, "second ran first");
  EXPECT_EQ(backend.batch_sizes(), (std::vector<size_t>{1, 1}));
}

TEST(BatcherTest, FullQueueRejectsAndReturnsTheRequest) {
  FakeClock clock;
  FakeBackend backend(1);
  ServerObserver observer;
  // Declared before the batcher: its destructor runs the two queued requests,
  // whose replies write to o[0] and o[1].
  const std::string payload = "q";
  Outcome plug, o[3];
  Batcher batcher(Options(64, 1'000'000, /*queue=*/2), &backend, &observer, &clock);
  KeepBusy(batcher, backend, &plug);  // the only slot: what follows stays queued
  for (int i = 0; i < 2; ++i) {
    auto r = MakeRequest(payload, 1, &o[i]);
    ASSERT_TRUE(batcher.Enqueue(r).ok());
  }
  auto r = MakeRequest(payload, 1, &o[2]);
  const absl::Status s = batcher.Enqueue(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(r, nullptr);  // still the caller's; its on_done will not be called
  EXPECT_EQ(batcher.queue_depth(), 2);
  backend.SetOpen(true);
  // The plug's reply may still be running on a reply thread: its Outcome
  // must outlive it.
  ASSERT_TRUE(plug.done.WaitFor(std::chrono::milliseconds(10000)));
}

// The queue is bounded by the bytes its requests hold too, not only by their
// count: 1 024 legal requests of 16 MB each would be 16 GB.
TEST(BatcherTest, QueueBytesLimitRejectsAndFreesAsBatchesStart) {
  FakeClock clock;
  FakeBackend backend(1);
  ServerObserver observer;
  const std::string four(4, 'f'), two(2, 't'), big(64, 'b');
  Outcome plugs[2], o[6];
  BatcherOptions options = Options(64, 1000);
  options.max_queue_bytes = 10;
  Batcher batcher(options, &backend, &observer, &clock);
  KeepBusy(batcher, backend, &plugs[0]);  // the only slot: what follows stays queued
  for (int i = 0; i < 2; ++i) {
    auto r = MakeRequest(four, 1, &o[i]);
    ASSERT_TRUE(batcher.Enqueue(r).ok());
  }
  auto over = MakeRequest(four, 1, &o[2]);
  const absl::Status s = batcher.Enqueue(over);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("8 bytes queued"), std::string_view::npos) << s;
  EXPECT_NE(over, nullptr);                // still the caller's
  auto fits = MakeRequest(two, 1, &o[3]);  // exactly at the limit
  ASSERT_TRUE(batcher.Enqueue(fits).ok());
  EXPECT_EQ(batcher.queue_depth(), 3);

  // The slot frees and the batch starts: its bytes leave the queue's account.
  backend.SetOpen(true);
  for (int i : {0, 1, 3}) ASSERT_TRUE(o[i].done.WaitFor(milliseconds(10000)));
  // A request larger than the whole limit is still taken by an empty queue,
  // or a small limit would make a legal request impossible to serve.
  KeepBusy(batcher, backend, &plugs[1]);
  auto alone = MakeRequest(big, 1, &o[4]);
  ASSERT_TRUE(batcher.Enqueue(alone).ok());
  auto behind = MakeRequest(two, 1, &o[5]);
  EXPECT_EQ(batcher.Enqueue(behind).code(), absl::StatusCode::kResourceExhausted);
  backend.SetOpen(true);
  ASSERT_TRUE(o[4].done.WaitFor(milliseconds(10000)));
  EXPECT_TRUE(o[4].status.ok()) << o[4].status;
}

// Without an explicit limit the queue holds kDefaultQueuedBatches full
// batches of FP32 tokens at the requests' hidden size, and never less than
// kMinDefaultQueueBytes; a limit is kept to the byte.
TEST(BatcherTest, QueueBytesLimitAndItsDefault) {
  EXPECT_EQ(DefaultMaxQueueBytes(BatchPolicy{8192, microseconds(500)}, 4096),
            int64_t{kDefaultQueuedBatches} * 8192 * 4096 * 4);
  EXPECT_EQ(DefaultMaxQueueBytes(BatchPolicy{int64_t{1} << 62, microseconds(500)}, 4096),
            INT64_MAX);  // saturates
  // Batching off (a batch of one 1-token request): the floor, not 8 requests.
  EXPECT_EQ(DefaultMaxQueueBytes(BatchPolicy{1, microseconds(500)}, 4096), kMinDefaultQueueBytes);

  FakeClock clock;  // never advanced: only a full batch leaves the queue
  FakeBackend backend(1);
  ServerObserver observer;
  constexpr int64_t kBatchTokens = 17;
  constexpr int64_t kTokens = 16;  // two of these never fit one batch
  const std::string full_batch(kBatchTokens * 4, 'f'), request(kTokens * 4, 'x');
  Outcome first;
  std::vector<Outcome> outs(kDefaultQueuedBatches + 1);
  BatcherOptions options = Options(kBatchTokens, 1'000'000);
  options.max_queue_bytes = kDefaultQueuedBatches * kBatchTokens * 4;
  Batcher batcher(options, &backend, &observer, &clock);
  backend.SetOpen(false);
  // A full batch takes the backend's only slot, so later requests stay queued.
  auto r0 = MakeRequest(full_batch, kBatchTokens, &first);
  r0->dtype = DType::kF32;
  ASSERT_TRUE(batcher.Enqueue(r0).ok());
  ASSERT_TRUE(backend.AwaitBatches(1));
  int accepted = 0;
  absl::Status refused;
  for (Outcome& o : outs) {
    auto r = MakeRequest(request, kTokens, &o);
    r->dtype = DType::kF32;
    const absl::Status s = batcher.Enqueue(r);
    if (s.ok()) {
      ++accepted;
    } else {
      refused = s;
    }
  }
  // kDefaultQueuedBatches x 17 tokens x 4 bytes: room for
  // kDefaultQueuedBatches requests of 16 tokens, not one more.
  EXPECT_EQ(accepted, kDefaultQueuedBatches);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  backend.SetOpen(true);
  batcher.Shutdown();  // runs what was queued, so every Outcome is written
}

TEST(BatcherTest, ExpiredAndCancelledRequestsAreDroppedBeforeCompute) {
  FakeClock clock;
  FakeBackend backend(2);  // one slot for the plug, one free
  ServerObserver observer;
  Batcher batcher(Options(64, 1000), &backend, &observer, &clock);
  Outcome plug;
  KeepBusy(batcher, backend, &plug);  // the device is busy: the delay holds the rest
  const std::string payload = "d";
  Outcome expired, cancelled, kept;
  auto re = MakeRequest(payload, 1, &expired);
  re->deadline = clock.Now() + microseconds(500);
  auto rc = MakeRequest(payload, 1, &cancelled);
  std::atomic<bool> cancel{false};
  rc->is_cancelled = [&cancel] { return cancel.load(); };
  auto rk = MakeRequest(payload, 1, &kept);
  ASSERT_TRUE(batcher.Enqueue(re).ok());
  ASSERT_TRUE(batcher.Enqueue(rc).ok());
  ASSERT_TRUE(batcher.Enqueue(rk).ok());
  cancel = true;
  clock.Advance(microseconds(600));  // past the deadline, before the batch is due
  batcher.Wake();
  ASSERT_TRUE(expired.done.WaitFor(milliseconds(10000)));
  EXPECT_EQ(expired.status.code(), absl::StatusCode::kDeadlineExceeded) << expired.status;
  ASSERT_TRUE(cancelled.done.WaitFor(milliseconds(10000)));
  EXPECT_EQ(cancelled.status.code(), absl::StatusCode::kCancelled) << cancelled.status;
  clock.Advance(microseconds(400));
  batcher.Wake();
  ASSERT_TRUE(backend.AwaitBatches(2));
  backend.SetOpen(true);
  ASSERT_TRUE(kept.done.WaitFor(milliseconds(10000)));
  EXPECT_TRUE(kept.status.ok());
  // Only the survivor ran, after the plug.
  EXPECT_EQ(backend.batch_sizes(), (std::vector<size_t>{1, 1}));
  // The plug's reply may still be running on a reply thread: its Outcome
  // must outlive it.
  ASSERT_TRUE(plug.done.WaitFor(std::chrono::milliseconds(10000)));
}

TEST(BatcherTest, ShutdownRunsQueuedWorkAndRefusesNewWork) {
  FakeClock clock;  // the delay never passes: only the drain can run these
  FakeBackend backend(1);
  ServerObserver observer;
  auto batcher = std::make_unique<Batcher>(Options(64, 1'000'000), &backend, &observer, &clock);
  const std::string payload = "s";
  std::vector<Outcome> outs(5);
  for (auto& o : outs) {
    auto r = MakeRequest(payload, 1, &o);
    ASSERT_TRUE(batcher->Enqueue(r).ok());
  }
  batcher->Shutdown();
  for (auto& o : outs) {
    ASSERT_TRUE(o.done.HasBeenNotified());  // Shutdown returns only after completion
    EXPECT_TRUE(o.status.ok()) << o.status;
  }
  Outcome late;
  auto r = MakeRequest(payload, 1, &late);
  EXPECT_EQ(batcher->Enqueue(r).code(), absl::StatusCode::kUnavailable);
}

TEST(BatcherTest, ManyProducersEveryRequestAnsweredOnceAndCorrectly) {
  SteadyClock* clock = SteadyClock::Get();
  FakeBackend backend(2);
  ServerObserver observer;
  constexpr int64_t kMaxTokens = 48;
  // Neither the count nor the bytes of waiting requests may refuse one here.
  BatcherOptions options = Options(kMaxTokens, 200, /*queue=*/1 << 20);
  options.max_queue_bytes = INT64_MAX;
  Batcher batcher(options, &backend, &observer, clock);
  constexpr int kThreads = 16, kPerThread = 100;
  std::vector<std::string> payloads(kThreads * kPerThread);
  std::vector<Outcome> outs(kThreads * kPerThread);
  std::atomic<int64_t> submitted_tokens{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const int idx = t * kPerThread + i;
        const int64_t tokens = 1 + (idx * 7) % 16;
        payloads[idx] = std::string(static_cast<size_t>(tokens), static_cast<char>('a' + idx % 20));
        auto r = MakeRequest(payloads[idx], tokens, &outs[idx]);
        ASSERT_TRUE(batcher.Enqueue(r).ok());
        submitted_tokens += tokens;
      }
    });
  }
  for (auto& th : threads) th.join();
  for (size_t i = 0; i < outs.size(); ++i) {
    ASSERT_TRUE(outs[i].done.WaitFor(milliseconds(20000))) << "request " << i;
    ASSERT_TRUE(outs[i].status.ok()) << outs[i].status;
    std::string expected = payloads[i];
    for (char& c : expected) c = static_cast<char>(c + 1);
    ASSERT_EQ(outs[i].output, expected) << "request " << i;
  }
  int64_t ran_tokens = 0;
  for (int64_t t : backend.batch_tokens()) {
    EXPECT_LE(t, kMaxTokens);
    ran_tokens += t;
  }
  EXPECT_EQ(ran_tokens, submitted_tokens.load());
  EXPECT_LT(backend.batch_sizes().size(), outs.size());  // some batching happened
}

}  // namespace
}  // namespace layerserve
