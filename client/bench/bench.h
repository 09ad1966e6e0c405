// Load generator behind `layerctl bench`: closed-loop (C workers, one request
// each at a time) or open-loop (requests issued at a target rate whatever the
// server's speed, Poisson or uniform arrivals), random [B, T, hidden] inputs,
// and a report of throughput, latency percentiles and errors by code.
//
// Measurement: requests issued during the warm-up are sent but not recorded.
// Recorded are the requests issued in [warm-up end, warm-up end + duration);
// throughput divides their successes by the time from the warm-up end to the
// last recorded completion, so slow tails are not flattered. Open-loop
// latencies run from each request's scheduled arrival time, so any lateness
// of the scheduler counts against them (no coordinated omission).
//
// Failures: a closed-loop worker whose request fails waits before its next
// one (BenchBackoff), so a server that refuses every call is not hammered at
// the speed of the refusals. A status that every further request would get
// too (IsFatalBenchStatus: the model, the shape or the datatype is wrong)
// stops the whole run, which then returns that status.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace layerserve::client {

// Threads of the closed loops by default (stateless requests, and sessions
// over unary calls; BenchOptions::threads, layerctl bench --threads); each
// polls its own completion queue and drives its share of the
// concurrent calls. Like perf_analyzer's few worker threads (and unlike a
// thread per call blocked in it), completions are taken where they arrive,
// and a concurrency of hundreds needs no more threads. The bench's CPU
// matters: it shares the machine with the server it measures. Design record
// 0014.
inline constexpr int kClosedLoopThreads = 4;

enum class Arrivals { kPoisson, kUniform };

struct BenchOptions {
  std::string model;
  int64_t batch = 1;   // B
  int64_t tokens = 1;  // T per sequence
  int64_t hidden = 0;  // 0: read from ModelMetadata
  std::string datatype = "FP32";
  int concurrency = 0;  // > 0 selects the closed loop
  // Client connections the load is spread over (RunBench's `clients`); set
  // by RunBench from the clients it is given.
  int connections = 1;
  double rate_per_second = 0;  // > 0 selects the open loop
  Arrivals arrivals = Arrivals::kPoisson;
  double duration_seconds = 10;
  double warmup_seconds = 0;
  // Closed loop: stop after issuing this many requests in all (warm-up ones
  // included), or at the end of the time, whichever comes first; 0: no
  // limit.
  int64_t requests = 0;
  int max_in_flight = 512;  // open loop: arrivals beyond it are skipped and counted
  // Threads of the closed loops (stateless, and sessions over unary calls),
  // each polling its own completion queue; at most one per concurrent call.
  int threads = kClosedLoopThreads;
  double timeout_seconds = 30;  // per-request deadline
  uint64_t seed = 1;
  bool progress = true;  // the \r-updated line on stderr, once a second

  // Sessions (RunSessionBench, session_bench.h; sessions > 0 selects it, and
  // then tokens, concurrency, rate, arrivals, duration, warm-up and
  // max_in_flight do not apply): `sessions` sessions at once, each a prefill
  // of [B, prefill_tokens] with sequence_start, then `steps` steps of [B,
  // step_tokens], the last with sequence_end.
  int64_t sessions = 0;
  int64_t prefill_tokens = 0;
  int64_t steps = 0;
  int64_t step_tokens = 1;
  // Session ids are "<prefix>-<i>"; empty: NewSessionIdPrefix(), random, so
  // that concurrent bench processes never share a session.
  std::string session_id_prefix;
  // Sessions only (--streaming): each session's requests go over its own
  // ModelStreamInfer stream (InferStream) instead of unary calls. The
  // request bench refuses it (INVALID_ARGUMENT naming --streaming).
  bool streaming = false;
};

struct BenchReport {
  BenchOptions options;  // as run (hidden resolved)
  double measured_seconds = 0;
  int64_t requests_ok = 0;
  int64_t requests_failed = 0;
  double requests_per_second = 0;  // successful requests
  double tokens_per_second = 0;    // successful requests * B * T
  double latency_mean_ms = 0;
  double latency_p50_ms = 0;
  double latency_p90_ms = 0;
  double latency_p99_ms = 0;
  double latency_max_ms = 0;
  std::map<std::string, int64_t> errors_by_code;  // "RESOURCE_EXHAUSTED" -> count
  // The message of each code's first failure: "RESOURCE_EXHAUSTED" -> "queue full: ..."
  std::map<std::string, std::string> first_error_by_code;
  // Open loop only: arrivals not sent because max_in_flight requests were
  // outstanding (the server could not keep up), and the worst lateness of
  // the scheduler against the arrival times.
  int64_t skipped_arrivals = 0;
  double max_schedule_lag_ms = 0;
};

// Runs the request benchmark against the server behind `clients` (at least one; give
// several with dedicated connections to spread the load over connections:
// closed-loop worker w uses clients[w % n], open-loop arrival i clients[i % n]).
// INVALID_ARGUMENT for inconsistent options (not a call's status: see
// IsCallStatus; options.sessions > 0 is one: that is RunSessionBench's, and
// options.streaming another: it needs sessions); a
// fatal status of a request (IsFatalBenchStatus) is
// returned with its code, its message prefixed and its payloads kept; other
// errors of individual requests are counted, not returned.
absl::StatusOr<BenchReport> RunBench(const std::vector<Client*>& clients, BenchOptions options);
absl::StatusOr<BenchReport> RunBench(Client& client, BenchOptions options);

// Human-readable summary (several lines) and the JSON form of the report.
std::string FormatBenchReport(const BenchReport& report);
std::string BenchReportJson(const BenchReport& report);

// Whether a request's failure would repeat for every request of the run, so
// the bench stops rather than retrying: the request or the model is wrong
// (INVALID_ARGUMENT, NOT_FOUND, UNIMPLEMENTED, FAILED_PRECONDITION,
// OUT_OF_RANGE) or the caller may not call (PERMISSION_DENIED,
// UNAUTHENTICATED). Load and transport errors (UNAVAILABLE,
// RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ...) are not fatal.
bool IsFatalBenchStatus(absl::StatusCode code);

// How long a closed-loop worker waits after its n-th consecutive failure
// (n >= 1): 1 ms, doubling, at most 1 s. Against a server that refuses every
// call a worker thus sends about one request a second instead of one per
// refusal (hundreds of thousands a second on loopback).
absl::Duration BenchBackoff(int consecutive_failures);

// Nearest-rank percentile (p in [0, 100]) of unsorted samples; 0 if empty.
double Percentile(std::vector<double> samples, double p);

struct LatencySummary {
  int64_t count = 0;
  double mean_ms = 0;
  double p50_ms = 0;
  double p90_ms = 0;
  double p99_ms = 0;
  double max_ms = 0;
};

// Count, mean, nearest-rank percentiles (Percentile) and maximum; all zero
// for no samples.
LatencySummary SummarizeLatencies(const std::vector<double>& samples_ms);

}  // namespace layerserve::client
