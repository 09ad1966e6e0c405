// Load generator (see bench.h). Closed loop: a few threads, each polling its
// own completion queue, keep `concurrency` calls in flight with requests built
// once (RunClosedLoop). Open loop: this thread sleeps
// until each arrival time and fires AsyncInfer; completions are recorded from gRPC's callback
// threads, so everything they touch is shared-owned and locked.
#include "client/bench/bench.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/bench/bench_common.h"
#include "grpcpp/alarm.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/support/async_unary_call.h"

namespace layerserve::client {
namespace {

// Thread-safe sink for request outcomes.
class Recorder {
 public:
  Recorder(absl::Time measure_start, absl::Time measure_end)
      : measure_start_(measure_start), measure_end_(measure_end) {}

  void Record(absl::Time issued, absl::Time completed, const absl::Status& status) {
    completed_total_.fetch_add(1, std::memory_order_relaxed);
    if (!status.ok()) errors_total_.fetch_add(1, std::memory_order_relaxed);
    if (issued < measure_start_ || issued >= measure_end_) return;
    absl::MutexLock lock(&mu_);
    last_completion_ = std::max(last_completion_, completed);
    if (status.ok()) {
      latencies_ms_.push_back(absl::ToDoubleMilliseconds(completed - issued));
    } else {
      CountError(status, errors_by_code_, first_error_by_code_);
      ++failed_;
    }
  }

  int64_t completed_total() const { return completed_total_.load(std::memory_order_relaxed); }
  int64_t errors_total() const { return errors_total_.load(std::memory_order_relaxed); }

  // `finished`: when the run's last call ended. A closed loop that stopped at
  // --requests before the measured window closed is measured up to then, not
  // to the window's end.
  void Fill(BenchReport& report, absl::Time finished) const {
    absl::MutexLock lock(&mu_);
    report.requests_ok = static_cast<int64_t>(latencies_ms_.size());
    report.requests_failed = failed_;
    report.errors_by_code = errors_by_code_;
    report.first_error_by_code = first_error_by_code_;
    const absl::Time end =
        std::max({last_completion_, std::min(measure_end_, finished), measure_start_});
    report.measured_seconds = absl::ToDoubleSeconds(end - measure_start_);
    if (report.measured_seconds > 0) {
      report.requests_per_second = report.requests_ok / report.measured_seconds;
      report.tokens_per_second = report.requests_per_second *
                                 static_cast<double>(report.options.batch * report.options.tokens);
    }
    const LatencySummary latency = SummarizeLatencies(latencies_ms_);
    report.latency_mean_ms = latency.mean_ms;
    report.latency_max_ms = latency.max_ms;
    report.latency_p50_ms = latency.p50_ms;
    report.latency_p90_ms = latency.p90_ms;
    report.latency_p99_ms = latency.p99_ms;
  }

 private:
  const absl::Time measure_start_;
  const absl::Time measure_end_;
  std::atomic<int64_t> completed_total_{0};
  std::atomic<int64_t> errors_total_{0};
  mutable absl::Mutex mu_;
  std::vector<double> latencies_ms_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> errors_by_code_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> first_error_by_code_ ABSL_GUARDED_BY(mu_);
  int64_t failed_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_completion_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// The progress line's text (bench_common.h's ProgressLine), once a second:
// elapsed time (marking the warm-up), requests done, requests/s over the last
// second, errors.
std::function<std::string()> RequestProgress(const Recorder* recorder, absl::Time start,
                                             absl::Time measure_start) {
  return [recorder, start, measure_start, previous_done = int64_t{0}]() mutable {
    const absl::Time now = absl::Now();
    const int64_t done = recorder->completed_total();
    std::string line =
        absl::StrFormat("[%6.1fs%s] done %lld | %.1f req/s | errors %lld   ",
                        absl::ToDoubleSeconds(now - start), now < measure_start ? " warm-up" : "",
                        static_cast<long long>(done), static_cast<double>(done - previous_done),
                        static_cast<long long>(recorder->errors_total()));
    previous_done = done;
    return line;
  };
}

// One concurrent stream of the closed loop: its call in flight, or its
// backoff after a failure.
struct Slot {
  Client* client = nullptr;
  size_t next = 0;  // index of its next request (slot w starts at w, then rotates)
  QueuedInfer call;
  std::unique_ptr<grpc::Alarm> backoff;  // set while waiting to retry
  int consecutive_failures = 0;
};

// `requests`: built once, before the clock starts (see RunBench). With
// options.requests, the slots stop after issuing that many in all.
void RunClosedLoop(const std::vector<Client*>& clients, const BenchOptions& options,
                   const std::vector<inference::ModelInferRequest>& requests,
                   absl::Time measure_end, Recorder& recorder, FatalStop& fatal) {
  std::atomic<int64_t> issued_count{0};
  // Starts the slot's next call on `cq`; false when the run is over for it.
  const auto issue = [&](Slot& slot, grpc::CompletionQueue* cq) {
    const absl::Time now = absl::Now();
    if (now >= measure_end || fatal.stopped()) return false;
    if (options.requests > 0 && issued_count.fetch_add(1) >= options.requests) return false;
    slot.call.Start(*slot.client, requests[slot.next % requests.size()], now,
                    absl::Seconds(options.timeout_seconds), cq, &slot);
    ++slot.next;
    return true;
  };
  const int threads = std::min(options.concurrency, options.threads);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      grpc::CompletionQueue cq;
      std::vector<std::unique_ptr<Slot>> slots;
      int active = 0;  // slots with a call or a backoff outstanding on `cq`
      for (int w = t; w < options.concurrency; w += threads) {
        auto slot = std::make_unique<Slot>();
        slot->client = clients[static_cast<size_t>(w) % clients.size()];
        slot->next = static_cast<size_t>(w);
        if (issue(*slot, &cq)) ++active;
        slots.push_back(std::move(slot));
      }
      void* tag = nullptr;
      bool ok = false;
      while (active > 0 && cq.Next(&tag, &ok)) {
        Slot& slot = *static_cast<Slot*>(tag);
        if (slot.backoff != nullptr) {  // the retry is due
          slot.backoff.reset();
          if (!issue(slot, &cq)) --active;
          continue;
        }
        const absl::Status status = slot.call.Outcome();
        recorder.Record(slot.call.issued, absl::Now(), status);
        if (IsFatalBenchStatus(status.code())) {
          fatal.Set(status);
          --active;
          continue;
        }
        if (!status.ok()) {
          ++slot.consecutive_failures;
          const absl::Time retry =
              std::min(absl::Now() + BenchBackoff(slot.consecutive_failures), measure_end);
          slot.backoff = std::make_unique<grpc::Alarm>();
          slot.backoff->Set(&cq, absl::ToChronoTime(retry), &slot);
          continue;
        }
        slot.consecutive_failures = 0;
        if (!issue(slot, &cq)) --active;
      }
      ShutDownQueue(cq);
    });
  }
  for (std::thread& worker : workers) worker.join();
}

struct InFlight {
  absl::Mutex mu;
  int count ABSL_GUARDED_BY(mu) = 0;
};

absl::Status RunOpenLoop(const std::vector<Client*>& clients, const BenchOptions& options,
                         const std::vector<Tensor>& inputs, absl::Time start,
                         absl::Time measure_start, absl::Time measure_end,
                         const std::shared_ptr<Recorder>& recorder,
                         const std::shared_ptr<FatalStop>& fatal, BenchReport& report) {
  auto in_flight = std::make_shared<InFlight>();
  std::mt19937_64 rng(options.seed ^ 0x9e3779b97f4a7c15ull);
  std::exponential_distribution<double> gap(options.rate_per_second);
  absl::Time next = start;
  for (size_t i = 0;; ++i) {
    next += absl::Seconds(options.arrivals == Arrivals::kPoisson ? gap(rng)
                                                                 : 1.0 / options.rate_per_second);
    if (next >= measure_end || fatal->WaitUntil(next)) break;
    const absl::Time issued = absl::Now();
    const bool measured = next >= measure_start;
    if (measured) {
      report.max_schedule_lag_ms =
          std::max(report.max_schedule_lag_ms, absl::ToDoubleMilliseconds(issued - next));
    }
    {
      absl::MutexLock lock(&in_flight->mu);
      if (in_flight->count >= options.max_in_flight) {
        if (measured) ++report.skipped_arrivals;
        continue;
      }
      ++in_flight->count;
    }
    clients[i % clients.size()]->AsyncInfer(
        options.model, inputs[i % inputs.size()], issued + absl::Seconds(options.timeout_seconds),
        [recorder, in_flight, fatal, scheduled = next](absl::StatusOr<Tensor> result) {
          recorder->Record(scheduled, absl::Now(), result.status());
          if (IsFatalBenchStatus(result.status().code())) fatal->Set(result.status());
          absl::MutexLock lock(&in_flight->mu);
          --in_flight->count;
        });
  }
  // Every call carries a deadline, so the drain ends; the margin covers
  // gRPC delivering the DEADLINE_EXCEEDED callbacks.
  absl::MutexLock lock(&in_flight->mu);
  const bool drained = in_flight->mu.AwaitWithTimeout(
      absl::Condition(
          +[](int* count) { return *count == 0; }, &in_flight->count),
      absl::Seconds(options.timeout_seconds + 10));
  if (!drained) {
    return absl::DeadlineExceededError(
        absl::StrCat(in_flight->count, " requests still outstanding after the run"));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsFatalBenchStatus(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
      return true;
    default:
      return false;
  }
}

absl::Duration BenchBackoff(int consecutive_failures) {
  constexpr int kMaxDoublings = 10;  // 1 ms * 2^10 = 1.024 s, capped at 1 s
  const int doublings = std::clamp(consecutive_failures - 1, 0, kMaxDoublings);
  return std::min(absl::Milliseconds(1) * (int64_t{1} << doublings), absl::Seconds(1));
}

double Percentile(std::vector<double> samples, double p) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(samples.size()));
  const size_t index = rank < 1 ? 0 : static_cast<size_t>(rank) - 1;
  return samples[std::min(index, samples.size() - 1)];
}

LatencySummary SummarizeLatencies(const std::vector<double>& samples_ms) {
  LatencySummary summary;
  if (samples_ms.empty()) return summary;
  summary.count = static_cast<int64_t>(samples_ms.size());
  double sum = 0;
  for (double v : samples_ms) sum += v;
  summary.mean_ms = sum / static_cast<double>(samples_ms.size());
  summary.max_ms = *std::max_element(samples_ms.begin(), samples_ms.end());
  summary.p50_ms = Percentile(samples_ms, 50);
  summary.p90_ms = Percentile(samples_ms, 90);
  summary.p99_ms = Percentile(samples_ms, 99);
  return summary;
}

absl::StatusOr<BenchReport> RunBench(Client& client, BenchOptions options) {
  return RunBench(std::vector<Client*>{&client}, std::move(options));
}

absl::StatusOr<BenchReport> RunBench(const std::vector<Client*>& clients, BenchOptions options) {
  if (clients.empty()) return absl::InvalidArgumentError("no client to run the benchmark with");
  Client& client = *clients.front();
  options.connections = static_cast<int>(clients.size());
  if (options.model.empty()) return absl::InvalidArgumentError("--model is required");
  if (options.sessions > 0) {
    return absl::InvalidArgumentError("--sessions runs the session bench (RunSessionBench)");
  }
  if (options.streaming) {
    return absl::InvalidArgumentError(
        "--streaming needs --sessions: only the session bench runs over streams");
  }
  if (options.batch < 1 || options.tokens < 1) {
    return absl::InvalidArgumentError("--batch and --tokens must be at least 1");
  }
  if ((options.concurrency > 0) == (options.rate_per_second > 0)) {
    return absl::InvalidArgumentError("give exactly one of --concurrency C or --rate R");
  }
  if (options.concurrency < 0 || options.rate_per_second < 0) {
    return absl::InvalidArgumentError("--concurrency and --rate must be positive");
  }
  if (!(options.duration_seconds > 0) || options.warmup_seconds < 0 ||
      !(options.timeout_seconds > 0) || options.max_in_flight < 1 || options.requests < 0) {
    return absl::InvalidArgumentError(
        "--duration-s and the timeout must be positive, --warmup-s and --requests non-negative, "
        "--max-in-flight at least 1");
  }
  if (absl::Status datatype = CheckBenchDatatype(options.datatype); !datatype.ok()) {
    return datatype;
  }
  if (options.hidden <= 0) {
    absl::StatusOr<int64_t> hidden = HiddenFromMetadata(client, options.model);
    if (!hidden.ok()) return hidden.status();
    options.hidden = *hidden;
  }

  const std::vector<Tensor> inputs = RandomInputs({options.batch, options.tokens, options.hidden},
                                                  options.datatype, options.seed, 4);
  // The closed loop's requests are built once, before the clock starts:
  // copying a tensor into a new request for every call costs the client as
  // much as the server's own copies (2 MiB per 128-token FP32 request).
  // Design record 0014. Four copies of a large input (32 MiB each at 2048
  // FP32 tokens) can take longer than a short run.
  std::vector<inference::ModelInferRequest> requests;
  if (options.concurrency > 0) {
    for (const Tensor& input : inputs) {
      requests.push_back(Client::MakeInferRequest(options.model, input));
    }
  }
  BenchReport report;
  report.options = options;
  const absl::Time start = absl::Now();
  const absl::Time measure_start = start + absl::Seconds(options.warmup_seconds);
  const absl::Time measure_end = measure_start + absl::Seconds(options.duration_seconds);
  auto recorder = std::make_shared<Recorder>(measure_start, measure_end);
  auto fatal = std::make_shared<FatalStop>();
  {
    ProgressLine progress(options.progress, RequestProgress(recorder.get(), start, measure_start));
    if (options.concurrency > 0) {
      RunClosedLoop(clients, options, requests, measure_end, *recorder, *fatal);
    } else {
      absl::Status status = RunOpenLoop(clients, options, inputs, start, measure_start, measure_end,
                                        recorder, fatal, report);
      if (!status.ok()) return status;
    }
  }
  if (fatal->stopped()) return StoppedBy(fatal->status());
  recorder->Fill(report, absl::Now());
  return report;
}

std::string FormatBenchReport(const BenchReport& r) {
  const BenchOptions& o = r.options;
  std::string mode =
      o.concurrency > 0
          ? absl::StrCat("closed loop, concurrency ", o.concurrency, " over ", o.connections,
                         o.connections == 1 ? " connection" : " connections")
          : absl::StrFormat("open loop, %.1f req/s %s arrivals", o.rate_per_second,
                            o.arrivals == Arrivals::kPoisson ? "Poisson" : "uniform");
  std::string out = absl::StrFormat(
      "model %s, input [%d, %d, %d] %s, %s, %.1f s measured\n"
      "throughput: %.2f req/s, %.1f tokens/s (%d ok, %d failed)\n"
      "latency ms: p50 %.2f  p90 %.2f  p99 %.2f  mean %.2f  max %.2f\n",
      o.model, o.batch, o.tokens, o.hidden, o.datatype, mode, r.measured_seconds,
      r.requests_per_second, r.tokens_per_second, r.requests_ok, r.requests_failed,
      r.latency_p50_ms, r.latency_p90_ms, r.latency_p99_ms, r.latency_mean_ms, r.latency_max_ms);
  absl::StrAppend(&out, FormatErrorLines(r.errors_by_code, r.first_error_by_code));
  if (o.rate_per_second > 0) {
    absl::StrAppendFormat(&out,
                          "scheduler: max lag %.2f ms, %d arrivals skipped at %d in flight%s\n",
                          r.max_schedule_lag_ms, r.skipped_arrivals, o.max_in_flight,
                          r.skipped_arrivals > 0 ? " (SATURATED: the server cannot keep up)" : "");
  }
  return out;
}

std::string BenchReportJson(const BenchReport& r) {
  const BenchOptions& o = r.options;
  nlohmann::json j;
  j["model"] = o.model;
  j["mode"] = o.concurrency > 0 ? "closed" : "open";
  j["transport"] = "unary";
  j["batch"] = o.batch;
  j["tokens"] = o.tokens;
  j["hidden"] = o.hidden;
  j["datatype"] = o.datatype;
  j["connections"] = o.connections;
  j["threads"] = o.threads;
  if (o.concurrency > 0) {
    j["concurrency"] = o.concurrency;
  } else {
    j["rate_per_second"] = o.rate_per_second;
    j["arrivals"] = o.arrivals == Arrivals::kPoisson ? "poisson" : "uniform";
    j["max_in_flight"] = o.max_in_flight;
    j["skipped_arrivals"] = r.skipped_arrivals;
    j["saturated"] = r.skipped_arrivals > 0;
    j["max_schedule_lag_ms"] = r.max_schedule_lag_ms;
  }
  j["duration_s"] = o.duration_seconds;
  j["warmup_s"] = o.warmup_seconds;
  j["measured_s"] = r.measured_seconds;
  j["requests_ok"] = r.requests_ok;
  j["requests_failed"] = r.requests_failed;
  j["requests_per_second"] = r.requests_per_second;
  j["tokens_per_second"] = r.tokens_per_second;
  j["latency_ms"] = {{"p50", r.latency_p50_ms},
                     {"p90", r.latency_p90_ms},
                     {"p99", r.latency_p99_ms},
                     {"mean", r.latency_mean_ms},
                     {"max", r.latency_max_ms}};
  j["errors_by_code"] = r.errors_by_code;
  j["first_error_by_code"] = r.first_error_by_code;
  // A message is the server's text: invalid UTF-8 in it is replaced rather
  // than thrown on.
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace layerserve::client
