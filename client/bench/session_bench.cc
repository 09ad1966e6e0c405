// Session load generator (see session_bench.h): unary sessions on a few
// threads polling completion queues, or one std::thread per session over an
// InferStream; a barrier between the prefill and decode phases, and one
// locked sink for the samples.
#include "client/bench/session_bench.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/bench/bench_common.h"

namespace layerserve::client {
namespace {

// What the session threads share: the phase barrier, the samples and the
// counters the progress line reads.
class SessionRun {
 public:
  // `participants`: the threads that meet at the barrier.
  SessionRun(int64_t participants, absl::Time start)
      : prefill_pending_(participants), start_(start) {}

  // Called once per participant after its sessions' prefills (answered or
  // not); blocks until every participant has called it. The last call starts
  // the decode phase.
  void FinishPrefillPhase() {
    absl::MutexLock lock(&mu_);
    if (--prefill_pending_ == 0) decode_start_ = absl::Now();
    mu_.Await(absl::Condition(
        +[](int64_t* pending) { return *pending == 0; }, &prefill_pending_));
  }

  void RecordPrefill(absl::Time issued, absl::Time done, const absl::Status& status) {
    if (status.ok()) prefills_done_.fetch_add(1, std::memory_order_relaxed);
    absl::MutexLock lock(&mu_);
    if (!status.ok()) return RecordErrorLocked(status);
    prefill_ms_.push_back(absl::ToDoubleMilliseconds(done - issued));
  }

  // `last`: the session's last step (its answer ends the session).
  void RecordStep(absl::Time issued, absl::Time done, const absl::Status& status, bool last) {
    if (status.ok()) steps_done_.fetch_add(1, std::memory_order_relaxed);
    absl::MutexLock lock(&mu_);
    if (!status.ok()) return RecordErrorLocked(status);
    step_ms_.push_back(absl::ToDoubleMilliseconds(done - issued));
    step_done_s_.push_back(absl::ToDoubleSeconds(done - decode_start_));
    last_step_done_ = std::max(last_step_done_, done);
    if (last) first_session_done_ = std::min(first_session_done_, done);
  }

  // A session whose requests were all answered, but whose stream's Close
  // failed.
  void RecordCloseError(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    RecordErrorLocked(
        absl::Status(status.code(), absl::StrCat("closing the stream: ", status.message())));
  }

  void RecordSession(bool completed) {
    absl::MutexLock lock(&mu_);
    if (completed) {
      ++completed_;
    } else {
      ++failed_;
    }
  }

  int64_t prefills_done() const { return prefills_done_.load(std::memory_order_relaxed); }
  int64_t steps_done() const { return steps_done_.load(std::memory_order_relaxed); }
  int64_t errors() const { return errors_.load(std::memory_order_relaxed); }

  void Fill(SessionBenchReport& report) const {
    absl::MutexLock lock(&mu_);
    report.sessions_completed = completed_;
    report.sessions_failed = failed_;
    report.prefills_ok = static_cast<int64_t>(prefill_ms_.size());
    report.steps_ok = static_cast<int64_t>(step_ms_.size());
    report.errors_by_code = errors_by_code_;
    report.first_error_by_code = first_error_by_code_;
    report.prefill_seconds = absl::ToDoubleSeconds(decode_start_ - start_);
    report.decode_seconds =
        step_ms_.empty() ? 0 : absl::ToDoubleSeconds(last_step_done_ - decode_start_);
    if (first_session_done_ != absl::InfiniteFuture()) {
      report.steady_decode_seconds = absl::ToDoubleSeconds(first_session_done_ - decode_start_);
      report.steady_steps_ok = SteadySteps(step_done_s_, report.steady_decode_seconds);
    }
    FinishSessionBenchReport(prefill_ms_, step_ms_, report);
  }

 private:
  void RecordErrorLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    errors_.fetch_add(1, std::memory_order_relaxed);
    CountError(status, errors_by_code_, first_error_by_code_);
  }

  mutable absl::Mutex mu_;
  int64_t prefill_pending_ ABSL_GUARDED_BY(mu_);
  const absl::Time start_;
  absl::Time decode_start_ ABSL_GUARDED_BY(mu_);
  absl::Time last_step_done_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time first_session_done_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::vector<double> prefill_ms_ ABSL_GUARDED_BY(mu_);
  std::vector<double> step_ms_ ABSL_GUARDED_BY(mu_);
  std::vector<double> step_done_s_ ABSL_GUARDED_BY(mu_);  // from the barrier
  std::map<std::string, int64_t> errors_by_code_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> first_error_by_code_ ABSL_GUARDED_BY(mu_);
  int64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t failed_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> prefills_done_{0};
  std::atomic<int64_t> steps_done_{0};
  std::atomic<int64_t> errors_{0};
};

// The progress line's text (bench_common.h's ProgressLine), once a second:
// elapsed time, prefills and steps answered of all, decode tokens/s over the
// last second, errors. `run` and `options` must outlive the line.
std::function<std::string()> SessionProgress(const SessionRun* run, const BenchOptions& options,
                                             absl::Time start) {
  return [run, &options, start, previous_steps = int64_t{0}]() mutable {
    const int64_t steps = run->steps_done();
    const double tokens_per_second =
        static_cast<double>((steps - previous_steps) * options.batch * options.step_tokens);
    std::string line = absl::StrFormat(
        "[%6.1fs] prefill %lld/%lld | steps %lld/%lld | %.1f decode tok/s | errors %lld   ",
        absl::ToDoubleSeconds(absl::Now() - start), static_cast<long long>(run->prefills_done()),
        static_cast<long long>(options.sessions), static_cast<long long>(steps),
        static_cast<long long>(options.sessions * options.steps), tokens_per_second,
        static_cast<long long>(run->errors()));
    previous_steps = steps;
    return line;
  };
}

// What every transport sends: session `index`'s request `i` of the plan,
// its input picked by rotation.
struct SessionRequests {
  const BenchOptions& options;
  const std::vector<SessionRequestPlan>& plan;
  const std::vector<Tensor>& prefill_inputs;
  const std::vector<Tensor>& step_inputs;

  const Tensor& Input(int64_t index, size_t i) const {
    const size_t pick = static_cast<size_t>(index);
    return i == 0 ? prefill_inputs[pick % prefill_inputs.size()]
                  : step_inputs[(pick + i) % step_inputs.size()];
  }
  InferOptions Options(int64_t index, size_t i) const {
    return {.sequence_id = SessionBenchId(options.session_id_prefix, index),
            .sequence_start = plan[i].start,
            .sequence_end = plan[i].end};
  }
  // Makes `request` session `index`'s request `i`. A step after the first
  // rewrites the previous step's message in place (its input bytes and
  // sequence_end), so a step costs the bench what a stateless call does,
  // not a new message with its parameters map and tensor copy.
  void Fill(int64_t index, size_t i, inference::ModelInferRequest& request) const {
    const bool reuse = i > 1 && request.raw_input_contents_size() == 1;
    if (!reuse) {
      request = Client::MakeInferRequest(options.model, Input(index, i), Options(index, i));
      return;
    }
    request.mutable_raw_input_contents(0)->assign(Input(index, i).data);
    (*request.mutable_parameters())["sequence_end"].set_bool_param(plan[i].end);
  }
};

// One session's life over its own stream: prefill, barrier, steps. Returns
// once it is done, abandoned or the run is stopped.
void RunStreamSession(Client& client, const SessionRequests& requests, int64_t index,
                      SessionRun& run, FatalStop& fatal) {
  const BenchOptions& options = requests.options;
  const size_t plan_size = requests.plan.size();
  // One deadline for the whole stream: a share per request and one for the
  // barrier (session_bench.h).
  std::unique_ptr<InferStream> stream = client.OpenStream(
      absl::Now() + absl::Seconds(options.timeout_seconds * static_cast<double>(plan_size + 1)),
      SessionBenchId(options.session_id_prefix, index));
  const auto send = [&](size_t i) {
    const absl::Time issued = absl::Now();
    absl::Status status =
        stream->Infer(options.model, requests.Input(index, i), requests.Options(index, i)).status();
    if (IsFatalBenchStatus(status.code())) fatal.Set(status);
    return std::make_pair(issued, status);
  };

  bool alive = !fatal.stopped();
  if (alive) {
    const auto [issued, status] = send(0);
    run.RecordPrefill(issued, absl::Now(), status);
    alive = status.ok();
  }
  run.FinishPrefillPhase();
  for (size_t i = 1; i < plan_size && alive; ++i) {
    if (fatal.stopped()) {
      alive = false;
      break;
    }
    const auto [issued, status] = send(i);
    run.RecordStep(issued, absl::Now(), status, i + 1 == plan_size);
    alive = status.ok();
  }
  // After a failed request the session is abandoned and its stream's failure
  // (if any) already counted.
  const absl::Status closed = stream->Close();
  if (alive && !closed.ok()) run.RecordCloseError(closed);
  run.RecordSession(alive);
}

// A unary session of the completion-queue runner: where it is in the plan,
// and its call in flight with the request it sends.
struct UnarySession {
  int64_t index = 0;
  Client* client = nullptr;
  size_t next = 0;  // the plan index of its next request
  bool alive = true;
  inference::ModelInferRequest request;
  QueuedInfer call;
};

// The sessions whose index is `first` modulo `threads`, over unary calls on
// this thread's completion queue, as the stateless closed loop runs its
// slots (so session rows and stateless rows cost the bench the same CPU per
// request): every session's prefill, the barrier once all of them are
// answered, then every session's steps, each sent as the one before is
// answered.
void RunUnarySessions(const std::vector<Client*>& clients, const SessionRequests& requests,
                      int64_t first, int64_t threads, SessionRun& run, FatalStop& fatal) {
  const BenchOptions& options = requests.options;
  const size_t plan_size = requests.plan.size();
  grpc::CompletionQueue cq;
  const auto issue = [&](UnarySession& s) {
    requests.Fill(s.index, s.next, s.request);
    s.call.Start(*s.client, s.request, absl::Now(), absl::Seconds(options.timeout_seconds), &cq,
                 &s);
  };
  // Takes completions until none is outstanding; in the decode phase each
  // answered step sends the session's next.
  const auto run_phase = [&](int active, bool prefill) {
    void* tag = nullptr;
    bool ok = false;
    while (active > 0 && cq.Next(&tag, &ok)) {
      UnarySession& s = *static_cast<UnarySession*>(tag);
      const absl::Status status = s.call.Outcome();
      if (prefill) {
        run.RecordPrefill(s.call.issued, absl::Now(), status);
        s.request = {};  // a prefill's input is large; steps build their own
      } else {
        run.RecordStep(s.call.issued, absl::Now(), status, s.next + 1 == plan_size);
      }
      if (IsFatalBenchStatus(status.code())) fatal.Set(status);
      s.alive = status.ok();
      if (s.alive) ++s.next;
      if (prefill || !s.alive || s.next >= plan_size || fatal.stopped()) {
        --active;
        continue;
      }
      issue(s);
    }
  };

  std::vector<std::unique_ptr<UnarySession>> sessions;
  for (int64_t i = first; i < options.sessions; i += threads) {
    auto s = std::make_unique<UnarySession>();
    s->index = i;
    s->client = clients[static_cast<size_t>(i) % clients.size()];
    sessions.push_back(std::move(s));
  }
  const auto start_all = [&] {
    int active = 0;
    for (auto& s : sessions) {
      if (!s->alive || s->next >= plan_size) continue;
      if (fatal.stopped()) {
        s->alive = false;
        continue;
      }
      issue(*s);
      ++active;
    }
    return active;
  };
  run_phase(start_all(), /*prefill=*/true);
  run.FinishPrefillPhase();
  run_phase(start_all(), /*prefill=*/false);
  for (const auto& s : sessions) run.RecordSession(s->alive && s->next >= plan_size);
  ShutDownQueue(cq);
}

}  // namespace

std::vector<SessionRequestPlan> PlanSessionRequests(const BenchOptions& options) {
  std::vector<SessionRequestPlan> plan;
  plan.reserve(static_cast<size_t>(std::max<int64_t>(options.steps, 0)) + 1);
  plan.push_back({.tokens = options.prefill_tokens, .start = true, .end = options.steps <= 0});
  for (int64_t step = 0; step < options.steps; ++step) {
    plan.push_back(
        {.tokens = options.step_tokens, .start = false, .end = step == options.steps - 1});
  }
  return plan;
}

std::string NewSessionIdPrefix() {
  std::random_device device;
  const uint64_t bits = (static_cast<uint64_t>(device()) << 32) ^ device();
  return absl::StrFormat("lsbench-%016x", bits);
}

std::string SessionBenchId(std::string_view prefix, int64_t index) {
  return absl::StrCat(absl::string_view(prefix.data(), prefix.size()), "-", index);
}

int64_t SteadySteps(const std::vector<double>& done_s, double window_s) {
  return std::count_if(done_s.begin(), done_s.end(), [&](double t) { return t <= window_s; });
}

void FinishSessionBenchReport(const std::vector<double>& prefill_ms,
                              const std::vector<double>& step_ms, SessionBenchReport& report) {
  const BenchOptions& o = report.options;
  report.prefill_latency = SummarizeLatencies(prefill_ms);
  report.step_latency = SummarizeLatencies(step_ms);
  report.prefill_tokens_per_second =
      report.prefill_seconds > 0
          ? static_cast<double>(report.prefills_ok * o.batch * o.prefill_tokens) /
                report.prefill_seconds
          : 0;
  report.decode_tokens_per_second =
      report.decode_seconds > 0
          ? static_cast<double>(report.steps_ok * o.batch * o.step_tokens) / report.decode_seconds
          : 0;
  report.steady_decode_tokens_per_second =
      report.steady_decode_seconds > 0
          ? static_cast<double>(report.steady_steps_ok * o.batch * o.step_tokens) /
                report.steady_decode_seconds
          : 0;
}

absl::StatusOr<SessionBenchReport> RunSessionBench(const std::vector<Client*>& clients,
                                                   BenchOptions options) {
  if (clients.empty()) return absl::InvalidArgumentError("no client to run the benchmark with");
  options.connections = static_cast<int>(clients.size());
  if (options.model.empty()) return absl::InvalidArgumentError("--model is required");
  if (options.sessions < 1 || options.prefill_tokens < 1 || options.steps < 0 ||
      options.step_tokens < 1 || options.batch < 1) {
    return absl::InvalidArgumentError(
        "--sessions, --prefill, --step-tokens and --batch must be at least 1, --steps at least 0");
  }
  if (options.concurrency != 0 || options.rate_per_second != 0) {
    return absl::InvalidArgumentError(
        "--sessions sets the load itself: give neither --concurrency nor --rate");
  }
  if (!(options.timeout_seconds > 0)) {
    return absl::InvalidArgumentError("--timeout-s must be positive");
  }
  if (absl::Status datatype = CheckBenchDatatype(options.datatype); !datatype.ok()) {
    return datatype;
  }
  if (options.session_id_prefix.empty()) options.session_id_prefix = NewSessionIdPrefix();
  if (options.session_id_prefix.size() > kMaxSessionIdPrefixBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the session id prefix has ",
                                                   options.session_id_prefix.size(),
                                                   " bytes; at most ", kMaxSessionIdPrefixBytes));
  }
  if (options.hidden <= 0) {
    absl::StatusOr<int64_t> hidden = HiddenFromMetadata(*clients.front(), options.model);
    if (!hidden.ok()) return hidden.status();
    options.hidden = *hidden;
  }

  const std::vector<SessionRequestPlan> plan = PlanSessionRequests(options);
  const std::vector<Tensor> prefill_inputs = RandomInputs(
      {options.batch, options.prefill_tokens, options.hidden}, options.datatype, options.seed, 2);
  const std::vector<Tensor> step_inputs = RandomInputs(
      {options.batch, options.step_tokens, options.hidden}, options.datatype, options.seed + 1, 4);
  SessionBenchReport report;
  report.options = options;
  const SessionRequests requests{options, plan, prefill_inputs, step_inputs};
  const absl::Time start = absl::Now();
  // Streams: a thread per session; unary calls: options.threads threads.
  const int64_t threads =
      options.streaming ? options.sessions : std::min<int64_t>(options.sessions, options.threads);
  SessionRun run(threads, start);
  FatalStop fatal;
  {
    ProgressLine progress(options.progress, SessionProgress(&run, options, start));
    std::vector<std::thread> workers;
    workers.reserve(static_cast<size_t>(threads));
    for (int64_t t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        if (options.streaming) {
          RunStreamSession(*clients[static_cast<size_t>(t) % clients.size()], requests, t, run,
                           fatal);
        } else {
          RunUnarySessions(clients, requests, t, threads, run, fatal);
        }
      });
    }
    for (std::thread& worker : workers) worker.join();
  }
  if (fatal.stopped()) return StoppedBy(fatal.status());
  run.Fill(report);
  return report;
}

std::string FormatSessionBenchReport(const SessionBenchReport& r) {
  const BenchOptions& o = r.options;
  const auto latency = [](const LatencySummary& l) {
    return absl::StrFormat("p50 %.2f  p90 %.2f  p99 %.2f  mean %.2f  max %.2f", l.p50_ms, l.p90_ms,
                           l.p99_ms, l.mean_ms, l.max_ms);
  };
  std::string out = absl::StrFormat(
      "model %s, %d sessions (ids %s-*) over %d %s, %s: prefill [%d, %d, %d], then %d steps "
      "of [%d, %d, %d] %s\n"
      "prefill: %.3f s, %.1f tokens/s (%d ok); latency ms: %s\n"
      "decode:  %.3f s, %.1f tokens/s (%d steps ok); step latency ms: %s\n"
      "decode while all sessions ran: %.3f s, %.1f tokens/s (%d steps)\n"
      "sessions: %d completed, %d failed\n",
      o.model, o.sessions, o.session_id_prefix, o.connections,
      o.connections == 1 ? "connection" : "connections",
      o.streaming ? "a stream per session" : "unary calls", o.batch, o.prefill_tokens, o.hidden,
      o.steps, o.batch, o.step_tokens, o.hidden, o.datatype, r.prefill_seconds,
      r.prefill_tokens_per_second, r.prefills_ok, latency(r.prefill_latency), r.decode_seconds,
      r.decode_tokens_per_second, r.steps_ok, latency(r.step_latency), r.steady_decode_seconds,
      r.steady_decode_tokens_per_second, r.steady_steps_ok, r.sessions_completed,
      r.sessions_failed);
  absl::StrAppend(&out, FormatErrorLines(r.errors_by_code, r.first_error_by_code));
  return out;
}

std::string SessionBenchReportJson(const SessionBenchReport& r) {
  const BenchOptions& o = r.options;
  const auto latency = [](const LatencySummary& l) {
    return nlohmann::json{{"count", l.count}, {"p50", l.p50_ms},   {"p90", l.p90_ms},
                          {"p99", l.p99_ms},  {"mean", l.mean_ms}, {"max", l.max_ms}};
  };
  nlohmann::json j;
  j["model"] = o.model;
  j["mode"] = "sessions";
  j["transport"] = o.streaming ? "stream" : "unary";
  j["batch"] = o.batch;
  j["hidden"] = o.hidden;
  j["datatype"] = o.datatype;
  j["connections"] = o.connections;
  j["threads"] = o.threads;
  j["sessions"] = o.sessions;
  j["prefill_tokens"] = o.prefill_tokens;
  j["steps"] = o.steps;
  j["step_tokens"] = o.step_tokens;
  j["session_id_prefix"] = o.session_id_prefix;
  j["sessions_completed"] = r.sessions_completed;
  j["sessions_failed"] = r.sessions_failed;
  j["prefills_ok"] = r.prefills_ok;
  j["steps_ok"] = r.steps_ok;
  j["prefill_s"] = r.prefill_seconds;
  j["decode_s"] = r.decode_seconds;
  j["prefill_tokens_per_second"] = r.prefill_tokens_per_second;
  j["decode_tokens_per_second"] = r.decode_tokens_per_second;
  j["steady_decode_s"] = r.steady_decode_seconds;
  j["steady_steps_ok"] = r.steady_steps_ok;
  j["steady_decode_tokens_per_second"] = r.steady_decode_tokens_per_second;
  j["prefill_latency_ms"] = latency(r.prefill_latency);
  j["step_latency_ms"] = latency(r.step_latency);
  j["errors_by_code"] = r.errors_by_code;
  j["first_error_by_code"] = r.first_error_by_code;
  // A message is the server's text: invalid UTF-8 in it is replaced rather
  // than thrown on.
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace layerserve::client
