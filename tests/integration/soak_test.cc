// Soak: the real server at saturation for LAYERSERVE_SOAK_SECONDS (default
// 60) under a mix of traffic, while the test samples the server's resident
// memory (/proc/<pid>/status VmRSS) every second. The mix:
//   - stateless requests of B 1..2, T 1..64 in FP32, BF16 and FP16, from
//     enough threads that the server always has a batch waiting;
//   - sessions: a prefill that starts the session, decode steps of one
//     token, sometimes a rollback (sequence_position one token back), and an
//     end; one in eight is abandoned to the idle timeout instead;
//   - malformed requests of every kind the edge refuses, and steps of
//     sessions that do not exist;
//   - requests whose deadline (1..30 ms) passes in the queue or in compute,
//     session steps among them;
//   - calls the client cancels 0..15 ms after sending them.
// Every call must get an answer its kind allows (OK for good requests, the
// documented code for bad ones, DEADLINE_EXCEEDED or CANCELLED where the
// client asked for it), and after the warm-up (the first quarter of the run,
// at most 15 s) the RSS must stay within kRssGrowthBoundKb of where it was.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "grpc_service.grpc.pb.h"
#include "tests/integration/async_results.h"
#include "tests/integration/cancelled_call.h"
#include "tests/integration/reference_check.h"
#include "tests/integration/server_process.h"

namespace layerserve::integration {
namespace {

using client::Client;
using client::InferOptions;
using client::Tensor;
using inference::ModelInferRequest;

constexpr int64_t kHidden = 512;  // the demo model's
constexpr char kModel[] = "demo";

// The server's limits in this test. A batch of at most 256 tokens (twice the
// mix's largest request) bounds the CPU backend's scratch. A 16 MiB KV cache
// holds 2048 tokens of the demo model on the CPU backend (8192 bytes a
// token), 128 blocks of 16: small enough to touch whole in the warm-up, and
// ten times what the mix's sessions held at once here (three workers'
// sessions of up to 42 tokens, 3 blocks each, the deadline worker's, and the
// abandoned ones, one or two, until the 2 s idle timeout frees them), so
// that a machine several times faster, abandoning sessions several times as
// often, still finds blocks free.
constexpr const char* kServerArgs[] = {"--max-batch-tokens=256", "--kv-cache-memory=16MiB",
                                       "--session-idle-timeout-s=2"};
// Priming (Soak::Prime): 16 sessions of 120 tokens hold 8 blocks each, all 128.
constexpr int kPrimeSessions = 16;
constexpr int64_t kPrimeTokens = 120;
constexpr int kBurst = 32;

// How much the server's RSS may grow after the warm-up. Its memory has
// ceilings by design, which Soak::Prime reaches in the first seconds: the KV
// cache's pages (taken as sessions first write them), the CPU backend's
// scratch (kept at the size of the largest batch it computed), gRPC's
// buffers for the most calls in flight. What still moves after that is the
// allocator: glibc's per-thread arenas grow in steps of their own as gRPC's
// and the backend's threads take turns, and settle within tens of seconds.
// Measured on a 2-core machine (six runs): 0.5 to 2.8 MiB of growth after a
// 15 s warm-up, and in a 100 s run none after the 30th second. Without the
// priming and the 256-token batches it was 6 to 18 MiB, in steps as rarer,
// larger batches came. The bound leaves about three times the largest growth
// measured, and fails a leak of 1 KiB a call (about 300 calls a second here:
// such a leak, injected on purpose, grew the RSS by 10 MiB).
constexpr int64_t kRssGrowthBoundKb = 8 * 1024;

absl::Duration SoakDuration() {
  const char* text = std::getenv("LAYERSERVE_SOAK_SECONDS");
  int64_t seconds = 60;
  if (text != nullptr && !absl::SimpleAtoi(text, &seconds)) {
    ADD_FAILURE() << "LAYERSERVE_SOAK_SECONDS=" << text << " is not a number of seconds";
  }
  // A few seconds at least, so that samples follow the warm-up.
  return absl::Seconds(std::max<int64_t>(seconds, 4));
}

// Answers by kind of call and code, and the calls that got an answer their
// kind does not allow. Thread-safe.
class Tally {
 public:
  // Counts `status` under `kind`; unexpected unless its code is in `allowed`.
  void Count(const std::string& kind, const absl::Status& status,
             std::initializer_list<absl::StatusCode> allowed) {
    const bool expected = std::find(allowed.begin(), allowed.end(), status.code()) != allowed.end();
    absl::MutexLock lock(&mu_);
    ++counts_[Key(kind, status.code())];
    if (!expected) NoteUnexpectedLocked(absl::StrCat(kind, ": ", status.ToString()));
  }
  void Unexpected(const std::string& what) {
    absl::MutexLock lock(&mu_);
    NoteUnexpectedLocked(what);
  }

  int64_t Get(const std::string& kind, absl::StatusCode code) {
    absl::MutexLock lock(&mu_);
    const auto it = counts_.find(Key(kind, code));
    return it == counts_.end() ? 0 : it->second;
  }
  int64_t Total() {
    absl::MutexLock lock(&mu_);
    int64_t total = 0;
    for (const auto& [key, count] : counts_) total += count;
    return total;
  }
  int64_t unexpected() {
    absl::MutexLock lock(&mu_);
    return unexpected_;
  }
  // One line per kind and code, then the first unexpected answers.
  std::string Report() {
    absl::MutexLock lock(&mu_);
    std::string text;
    for (const auto& [key, count] : counts_) {
      absl::StrAppend(&text, "[soak]   ", key, ": ", count, "\n");
    }
    for (const std::string& what : first_unexpected_) {
      absl::StrAppend(&text, "[soak] unexpected: ", what, "\n");
    }
    return text;
  }

 private:
  static std::string Key(const std::string& kind, absl::StatusCode code) {
    return absl::StrCat(kind, " ", absl::StatusCodeToString(code));
  }
  void NoteUnexpectedLocked(std::string what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++unexpected_;
    // The first few say what went wrong; thousands would bury them.
    if (first_unexpected_.size() < 10) first_unexpected_.push_back(std::move(what));
  }

  absl::Mutex mu_;
  std::map<std::string, int64_t> counts_ ABSL_GUARDED_BY(mu_);
  int64_t unexpected_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> first_unexpected_ ABSL_GUARDED_BY(mu_);
};

// A [batch, tokens, hidden] tensor of bf16-exact values (so every datatype
// carries them unchanged).
Tensor MakeInput(int64_t batch, int64_t tokens, const char* datatype, uint64_t seed) {
  const std::vector<float> x = RandomBf16ExactValues(batch * tokens * kHidden, seed);
  absl::StatusOr<Tensor> tensor = client::FloatsToTensor(x, {batch, tokens, kHidden}, datatype);
  EXPECT_TRUE(tensor.ok()) << tensor.status();
  return tensor.ok() ? *std::move(tensor) : Tensor{};
}

// The malformed requests the soak keeps sending, each with the code the
// docs/protocol.md's error table gives it.
struct BadRequest {
  std::string name;
  ModelInferRequest request;
  absl::StatusCode code;
};

std::vector<BadRequest> BadRequests() {
  const ModelInferRequest good = Client::MakeInferRequest(kModel, MakeInput(1, 2, "FP32", 7));
  std::vector<BadRequest> bad;
  const auto add = [&](std::string name, absl::StatusCode code, auto change) {
    ModelInferRequest request = good;
    change(request);
    bad.push_back({std::move(name), std::move(request), code});
  };
  const auto invalid = absl::StatusCode::kInvalidArgument;
  add("bad INT32", invalid,
      [](ModelInferRequest& r) { r.mutable_inputs(0)->set_datatype("INT32"); });
  add("bad hidden", invalid, [](ModelInferRequest& r) { r.mutable_inputs(0)->set_shape(2, 256); });
  add("bad rank", invalid,
      [](ModelInferRequest& r) { r.mutable_inputs(0)->mutable_shape()->RemoveLast(); });
  add("bad bytes", invalid,
      [](ModelInferRequest& r) { r.mutable_raw_input_contents(0)->pop_back(); });
  add("bad two inputs", invalid, [](ModelInferRequest& r) { *r.add_inputs() = r.inputs(0); });
  add("bad typed contents", invalid,
      [](ModelInferRequest& r) { r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1); });
  add("bad huge name", invalid,
      [](ModelInferRequest& r) { r.mutable_inputs(0)->set_name(std::string(64 << 10, 'x')); });
  add("bad token limit", invalid, [](ModelInferRequest& r) {
    r.mutable_inputs(0)->set_shape(1, 9000);  // past --max-batch-tokens
    r.clear_raw_input_contents();
  });
  add("bad stray sequence_end", invalid,
      [](ModelInferRequest& r) { (*r.mutable_parameters())["sequence_end"].set_bool_param(true); });
  add("bad unknown model", absl::StatusCode::kNotFound,
      [](ModelInferRequest& r) { r.set_model_name("no_such_model"); });
  add("bad unknown session", absl::StatusCode::kNotFound, [](ModelInferRequest& r) {
    (*r.mutable_parameters())["sequence_id"].set_string_param("never-started");
  });
  return bad;
}

class Soak {
 public:
  Soak(const ServerProcess& server, Client& client, absl::Time stop)
      : server_(server), client_(client), stop_(stop) {
    // FP32 last, so that the last input is the largest.
    static constexpr const char* kDatatypes[] = {"BF16", "FP16", "FP32"};
    uint64_t seed = 100;
    for (const char* datatype : kDatatypes) {
      for (const int64_t batch : {1, 2}) {
        for (const int64_t tokens : {1, 4, 16, 64}) {
          stateless_inputs_.push_back(MakeInput(batch, tokens, datatype, ++seed));
        }
      }
    }
    for (const int64_t tokens : {1, 8, 16, 32}) {
      session_inputs_[tokens] = MakeInput(1, tokens, "BF16", ++seed);
    }
  }

  // Stateless requests, one at a time, each a random size and datatype.
  void Stateless(uint64_t seed) {
    std::mt19937_64 rng(seed);
    while (absl::Now() < stop_) {
      const Tensor& input = stateless_inputs_[rng() % stateless_inputs_.size()];
      const std::string kind = absl::StrCat("stateless T=", input.shape[1]);
      absl::StatusOr<Tensor> output = client_.Infer(kModel, input, absl::Now() + absl::Seconds(60));
      tally_.Count(kind, output.status(), {absl::StatusCode::kOk});
      if (output.ok() && (output->shape != input.shape || output->datatype != input.datatype ||
                          output->data.size() != input.data.size())) {
        tally_.Unexpected(absl::StrCat(kind, ": a reply of another shape or datatype"));
      }
    }
  }

  // Sessions one after another: a prefill of 8..32 tokens that starts the
  // session, 3..10 decode steps (a quarter of them rolling back one token and
  // decoding it again), and a last step that ends it, unless the session is
  // one of the eighth abandoned to the idle timeout.
  void Sessions(int worker) {
    std::mt19937_64 rng(1000 + worker);
    for (int64_t n = 0; absl::Now() < stop_; ++n) {
      InferOptions options;
      options.sequence_id = n % 2 == 0 ? client::SequenceId(int64_t{1'000'000} * (worker + 1) + n)
                                       : client::SequenceId(absl::StrCat("soak-", worker, "-", n));
      options.sequence_start = true;
      static constexpr int64_t kPrefills[] = {8, 16, 32};
      int64_t length = kPrefills[rng() % 3];
      const int steps = 3 + static_cast<int>(rng() % 8);
      const bool abandon = rng() % 8 == 0;
      if (!Step("session prefill", session_inputs_[length], options)) continue;
      options.sequence_start = false;
      for (int step = 1; step <= steps && absl::Now() < stop_; ++step) {
        options.sequence_end = step == steps && !abandon;
        options.sequence_position.reset();
        const bool rollback = rng() % 4 == 0;
        if (rollback) options.sequence_position = length - 1;
        if (!Step(rollback ? "session rollback" : "session step", session_inputs_[1], options)) {
          break;
        }
        if (!rollback) ++length;
      }
    }
  }

  // The malformed requests in turn, a few hundred a second: each is cheap for
  // the server, and a tight loop would starve the good traffic of the CPU.
  void Malformed() {
    const std::vector<BadRequest> bad = BadRequests();
    for (size_t i = 0; absl::Now() < stop_; ++i) {
      const BadRequest& b = bad[i % bad.size()];
      const absl::StatusOr<inference::ModelInferResponse> response =
          client_.InferRaw(b.request, absl::Now() + absl::Seconds(60));
      tally_.Count(b.name, response.status(), {b.code});
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  // Requests with deadlines of 1..30 ms, which pass while they wait behind
  // the saturated queue (the batcher drops them) or while they compute;
  // every fourth round a session whose decode steps have such deadlines. A
  // step that misses its deadline may or may not have been applied; the
  // session appends either way, since the steps name no position.
  void Deadlines() {
    std::mt19937_64 rng(2000);
    const Tensor input = MakeInput(1, 64, "FP32", 3);
    for (int64_t n = 0; absl::Now() < stop_; ++n) {
      const auto tight = [&] { return absl::Now() + absl::Milliseconds(1 + rng() % 30); };
      const auto allowed = {absl::StatusCode::kOk, absl::StatusCode::kDeadlineExceeded};
      tally_.Count("deadline stateless", client_.Infer(kModel, input, tight()).status(), allowed);
      if (n % 4 != 0) continue;
      InferOptions options;
      options.sequence_id = absl::StrCat("soak-deadline-", n);
      options.sequence_start = true;
      if (!Step("deadline session start", session_inputs_[8], options)) continue;
      options.sequence_start = false;
      for (int step = 0; step < 3; ++step) {
        tally_.Count("deadline session step",
                     client_.Infer(kModel, session_inputs_[1], tight(), options).status(), allowed);
      }
      options.sequence_end = true;
      Step("deadline session end", session_inputs_[1], options);
    }
  }

  // Calls cancelled by the client 0..15 ms after they leave, through the
  // stub (the client library has no cancel).
  void Cancels() {
    std::mt19937_64 rng(3000);
    auto stub = inference::GRPCInferenceService::NewStub(
        grpc::CreateChannel(server_.grpc_target(), grpc::InsecureChannelCredentials()));
    const ModelInferRequest request = Client::MakeInferRequest(kModel, MakeInput(1, 16, "BF16", 4));
    while (absl::Now() < stop_) {
      const std::optional<grpc::Status> status =
          InferCancelledAfter(*stub, request, absl::Milliseconds(rng() % 16), absl::Seconds(60));
      if (!status) {
        tally_.Unexpected("a cancelled call never completed");
        continue;
      }
      tally_.Count("cancel", client::FromGrpcStatus(*status),
                   {absl::StatusCode::kOk, absl::StatusCode::kCancelled});
    }
  }

  // Drives the server's memory to the ceilings it has by design, at the
  // start of the warm-up rather than at some rare moment after it:
  //   - every block of the KV cache touched once (the CPU backend's pool
  //     takes its pages as sessions first write them): kPrimeSessions
  //     sessions of kPrimeTokens tokens open at once hold all of them;
  //   - the CPU backend's scratch, which keeps the size of the largest batch
  //     it computed, at --max-batch-tokens, and gRPC's buffers at more calls
  //     in flight than the mix ever has: kBurst calls at once of the mix's
  //     largest request.
  void Prime() {
    std::vector<InferOptions> sessions(kPrimeSessions);
    const Tensor prefill = MakeInput(1, kPrimeTokens, "BF16", 5);
    for (int i = 0; i < kPrimeSessions; ++i) {
      sessions[i].sequence_id = absl::StrCat("soak-prime-", i);
      sessions[i].sequence_start = true;
      Step("prime session start", prefill, sessions[i]);
    }
    // On a loaded machine the starts can outlast the 2 s idle timeout, and
    // the sweeper frees the first sessions before their end arrives
    // (NOT_FOUND, "expired"): their blocks have been touched all the same.
    for (InferOptions& options : sessions) {
      options.sequence_start = false;
      options.sequence_end = true;
      const absl::Status status =
          client_.Infer(kModel, session_inputs_[1], absl::Now() + absl::Seconds(60), options)
              .status();
      tally_.Count("prime session end", status,
                   {absl::StatusCode::kOk, absl::StatusCode::kNotFound});
    }
    const Tensor& largest = stateless_inputs_.back();  // FP32 [2, 64, hidden]
    const std::shared_ptr<AsyncResults> burst = AsyncResults::Create(kBurst);
    for (int i = 0; i < kBurst; ++i) {
      client_.AsyncInfer(kModel, largest, absl::Now() + absl::Seconds(60), burst->Callback(i));
    }
    absl::StatusOr<std::vector<absl::StatusOr<Tensor>>> done = burst->Wait(absl::Seconds(90));
    if (!done.ok()) return tally_.Unexpected(std::string(done.status().message()));
    for (const absl::StatusOr<Tensor>& result : *done) {
      tally_.Count("prime burst", result.status(), {absl::StatusCode::kOk});
    }
  }

  Tally& tally() { return tally_; }

 private:
  // One session request with a generous deadline; true if it succeeded.
  bool Step(const std::string& kind, const Tensor& input, const InferOptions& options) {
    const absl::Status status =
        client_.Infer(kModel, input, absl::Now() + absl::Seconds(60), options).status();
    tally_.Count(kind, status, {absl::StatusCode::kOk});
    return status.ok();
  }

  const ServerProcess& server_;
  Client& client_;
  const absl::Time stop_;
  std::vector<Tensor> stateless_inputs_;
  std::map<int64_t, Tensor> session_inputs_;  // [1, T, hidden] BF16 by T
  Tally tally_;
};

struct RssSample {
  double seconds;  // since the load started
  int64_t kb;
};

TEST(SoakTest, SaturatedMixKeepsRssFlat) {
  const absl::Duration duration = SoakDuration();
  const absl::Duration warm_up = std::min(absl::Seconds(15), duration / 4);
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start({std::begin(kServerArgs), std::end(kServerArgs)});
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect((*server)->grpc_target());
  ASSERT_TRUE(client.ok()) << client.status();
  const pid_t pid = (*server)->pid();
  const auto rss_kb = [pid] {
    absl::StatusOr<int64_t> kb = ProcStatusKb(pid, "VmRSS");
    EXPECT_TRUE(kb.ok()) << kb.status();
    return kb.value_or(0);
  };
  const int64_t start_kb = rss_kb();

  const absl::Time start = absl::Now();
  Soak soak(**server, **client, start + duration);
  soak.Prime();
  const double primed_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const int64_t primed_kb = rss_kb();
  std::vector<std::thread> threads;
  for (int i = 0; i < 6; ++i) threads.emplace_back([&soak, i] { soak.Stateless(i); });
  for (int i = 0; i < 3; ++i) threads.emplace_back([&soak, i] { soak.Sessions(i); });
  threads.emplace_back([&soak] { soak.Malformed(); });
  threads.emplace_back([&soak] { soak.Deadlines(); });
  threads.emplace_back([&soak] { soak.Cancels(); });

  std::vector<RssSample> samples;
  for (int64_t second = 1; absl::Now() < start + duration; ++second) {
    absl::SleepFor(start + absl::Seconds(second) - absl::Now());
    samples.push_back({absl::ToDoubleSeconds(absl::Now() - start), rss_kb()});
  }
  for (std::thread& thread : threads) thread.join();
  const double load_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const int64_t end_kb = rss_kb();
  // Still serving after it all.
  EXPECT_TRUE(
      (*client)->Infer(kModel, MakeInput(1, 4, "FP32", 9), absl::Now() + absl::Seconds(30)).ok());

  // The sample at the end of the warm-up, and the largest after it.
  const double warm_seconds = absl::ToDoubleSeconds(warm_up);
  auto warm = std::find_if(samples.begin(), samples.end(),
                           [&](const RssSample& s) { return s.seconds >= warm_seconds; });
  ASSERT_NE(warm, samples.end()) << "no RSS sample after the warm-up";
  int64_t max_kb = warm->kb;
  // Least-squares slope of the samples after the warm-up, for the report.
  double n = 0, sum_t = 0, sum_kb = 0, sum_tt = 0, sum_tkb = 0;
  for (auto it = warm; it != samples.end(); ++it) {
    max_kb = std::max(max_kb, it->kb);
    n += 1;
    sum_t += it->seconds;
    sum_kb += static_cast<double>(it->kb);
    sum_tt += it->seconds * it->seconds;
    sum_tkb += it->seconds * static_cast<double>(it->kb);
  }
  const double slope_kb_per_min =
      n > 1 ? 60 * (n * sum_tkb - sum_t * sum_kb) / (n * sum_tt - sum_t * sum_t) : 0;
  const int64_t growth_kb = std::max(max_kb, end_kb) - warm->kb;

  std::string series;
  for (const RssSample& s : samples) absl::StrAppend(&series, " ", s.kb / 1024);
  Tally& tally = soak.tally();
  std::fprintf(stderr,
               "[soak] %.0f s of load (primed in %.1f s, warm-up %.0f s), %lld calls answered\n%s"
               "[soak] VmRSS: start %lld kB, primed %lld kB, after warm-up %lld kB, max after "
               "warm-up %lld kB, end %lld kB; growth after warm-up %lld kB (bound %lld kB), slope "
               "%.0f kB/min\n"
               "[soak] VmRSS every second (MiB):%s\n",
               load_seconds, primed_seconds, warm_seconds, static_cast<long long>(tally.Total()),
               tally.Report().c_str(), static_cast<long long>(start_kb),
               static_cast<long long>(primed_kb), static_cast<long long>(warm->kb),
               static_cast<long long>(max_kb), static_cast<long long>(end_kb),
               static_cast<long long>(growth_kb), static_cast<long long>(kRssGrowthBoundKb),
               slope_kb_per_min, series.c_str());

  EXPECT_EQ(tally.unexpected(), 0) << "calls got answers their kind does not allow (above)";
  EXPECT_LE(growth_kb, kRssGrowthBoundKb) << "the server's RSS grew after the warm-up";
  // Each part of the mix happened, or the soak did not test what it says.
  for (const char* kind : {"stateless T=1", "stateless T=64", "session prefill", "session step",
                           "session rollback", "deadline session start"}) {
    EXPECT_GT(tally.Get(kind, absl::StatusCode::kOk), 0) << kind;
  }
  EXPECT_GT(tally.Get("deadline stateless", absl::StatusCode::kDeadlineExceeded), 0);
  EXPECT_GT(tally.Get("cancel", absl::StatusCode::kCancelled), 0);
  EXPECT_GT(tally.Get("bad unknown session", absl::StatusCode::kNotFound), 0);
}

}  // namespace
}  // namespace layerserve::integration
