// Session load behind `layerctl bench --sessions N --prefill P --steps S
// [--step-tokens K]`: what decoding through the server's KV cache costs.
//
// N sessions run at once (session i on clients[i % n]), over unary calls
// driven from BenchOptions::threads threads that poll completion queues, as the
// stateless closed loop's are (so both cost the bench the same CPU per
// request), or with `streaming` one thread each over an InferStream of its
// own (Client::OpenStream on the same client); each request is sent once the
// one before is answered. Each sends a prefill of [B, P, hidden] with
// sequence_start, then S steps of [B, K, hidden], the last with sequence_end
// (with S = 0 the prefill carries it). The run has two phases: every session
// prefills; once the last prefill is answered (a barrier), every session
// decodes. So the decode phase measures decoding alone, with all N sessions
// holding their KV cache:
//   prefill tokens/s = prefills answered x B x P / prefill wall time
//                      (from the start to the last prefill's answer)
//   decode tokens/s  = steps answered x B x K / decode wall time
//                      (from the barrier to the last step's answer);
//                      N x S x K x B / wall time when nothing failed.
//   steady decode tokens/s = the same over the window in which all N
//                      sessions decode (from the barrier to the first
//                      session's last answer): the rate at concurrency N,
//                      without the tail in which the slowest sessions
//                      finish alone.
// Latencies are per request: one prefill latency per session, one step
// latency per decode step. Over a stream, from the write of the request to
// its reply (the prefill's includes opening the stream, which gRPC does on
// the first write).
//
// Deadlines: a unary request's is --timeout-s (timeout_seconds) from when it
// is sent. A stream has one deadline for all it carries: timeout_seconds x
// (2 + steps) from its opening, a request's share and one more for the wait
// at the barrier; once it passes, the stream breaks with DEADLINE_EXCEEDED
// and the session is abandoned.
//
// Ids: string sequence ids "<prefix>-<i>", the prefix random per run
// (NewSessionIdPrefix), so that bench processes running at once against one
// server never step each other's sessions.
//
// Failures: a fatal status (IsFatalBenchStatus: the model has no sessions,
// FAILED_PRECONDITION; a session not found, NOT_FOUND, e.g. freed by the
// idle timeout; a malformed request) stops the run, which returns it. Any
// other failure of a session's request abandons that session: it is counted
// as failed, its remaining steps are not sent (its stream, if any, is
// closed), and the server frees it at its idle timeout. Every failure is
// counted by code, with the first message of each code kept
// (first_error_by_code); a stream that fails to close after a completed
// session is counted too (its message says so), though the session stays
// completed. A step is not retried: after a client-side deadline the
// server may still be computing it, and a retry would be refused as a second
// step in flight.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "client/bench/bench.h"
#include "client/client.h"

namespace layerserve::client {

// One request of a session, in order.
struct SessionRequestPlan {
  int64_t tokens = 0;  // T of the [B, T, hidden] tensor
  bool start = false;
  bool end = false;
  friend bool operator==(const SessionRequestPlan&, const SessionRequestPlan&) = default;
};

// The requests of every session: the prefill, then options.steps steps.
std::vector<SessionRequestPlan> PlanSessionRequests(const BenchOptions& options);

// "lsbench-" and 16 hex digits from std::random_device (64 random bits):
// two runs draw the same prefix with probability 2^-64.
std::string NewSessionIdPrefix();

// The id of session `index` of a run: "<prefix>-<index>".
std::string SessionBenchId(std::string_view prefix, int64_t index);

// Longest prefix RunSessionBench accepts, so that every id stays within the
// server's 256-byte limit on string sequence ids (20 digits and a '-' left).
inline constexpr size_t kMaxSessionIdPrefixBytes = 256 - 21;

struct SessionBenchReport {
  BenchOptions options;            // as run (hidden and session_id_prefix resolved)
  int64_t sessions_completed = 0;  // every request answered
  int64_t sessions_failed = 0;     // abandoned after a failed request
  int64_t prefills_ok = 0;
  int64_t steps_ok = 0;
  double prefill_seconds = 0;  // start -> last prefill answered
  double decode_seconds = 0;   // barrier -> last step answered
  double prefill_tokens_per_second = 0;
  double decode_tokens_per_second = 0;
  // The decode phase while every session still decodes: from the barrier to
  // the first session's last step. A closed loop's sessions drift apart, and
  // the last ones finish at a lower concurrency; this window is what a
  // stateless closed loop at concurrency N measures (SteadySteps).
  double steady_decode_seconds = 0;  // barrier -> first session's last step answered
  int64_t steady_steps_ok = 0;       // steps answered in that window
  double steady_decode_tokens_per_second = 0;
  LatencySummary prefill_latency;
  LatencySummary step_latency;
  std::map<std::string, int64_t> errors_by_code;  // "RESOURCE_EXHAUSTED" -> count
  // The message of each code's first failure: "RESOURCE_EXHAUSTED" ->
  // "session \"lsbench-...-5\": out of KV cache blocks: ..."
  std::map<std::string, std::string> first_error_by_code;
};

// How many of the steps answered at `done_s` (seconds from the barrier) were
// answered by `window_s`, the end of the window in which every session
// still decoded (inclusive: the step that closes it counts).
int64_t SteadySteps(const std::vector<double>& done_s, double window_s);

// Fills the rates and latency summaries of `report` from its counts and
// phase times and the latency samples (the pure part of RunSessionBench).
void FinishSessionBenchReport(const std::vector<double>& prefill_ms,
                              const std::vector<double>& step_ms, SessionBenchReport& report);

// Runs the session benchmark against the server behind `clients` (at least
// one). INVALID_ARGUMENT naming the flag for inconsistent options (sessions,
// prefill_tokens, step_tokens and batch >= 1, steps >= 0, no concurrency or
// rate, a known datatype, a prefix of at most kMaxSessionIdPrefixBytes);
// a fatal request status as RunBench returns it; other request failures are
// counted in the report.
absl::StatusOr<SessionBenchReport> RunSessionBench(const std::vector<Client*>& clients,
                                                   BenchOptions options);

// Human-readable summary (several lines) and the JSON form of the report;
// both say which transport ran (JSON "transport": "unary" or "stream") and
// give each error code's first message ("errors CODE: N (first: ...)";
// JSON "first_error_by_code").
std::string FormatSessionBenchReport(const SessionBenchReport& report);
std::string SessionBenchReportJson(const SessionBenchReport& report);

}  // namespace layerserve::client
