// What the core reports about its work, for metrics and statistics.
//
// server/metrics implements this interface with Prometheus collectors and the
// gRPC layer's ModelStatistics reads a StatsRecorder; the core depends on
// neither. Callbacks may come from any thread (gRPC, batcher, backend
// completion) and must be cheap and thread-safe; they are never called with a
// core lock held.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "server/core/sessions.h"

namespace layerserve {

// One finished ModelInfer call, whatever its outcome, as seen at the edge.
struct RequestRecord {
  // The served model's name; empty when the call named a model or version
  // this server does not serve (the client's string is never passed on).
  std::string_view model;
  std::string_view code;        // canonical status code name: "OK", "INVALID_ARGUMENT", ...
  double duration_seconds = 0;  // receipt -> reply
  int64_t tokens = 0;           // B*T, 0 if the request never parsed
  // The compute time of the batches the request ran in (the sum over its
  // pieces for a chunked one); 0 when it never ran. A request's duration less
  // its queue wait and this is what the server spent on it outside batches.
  double compute_seconds = 0;
  // Its batch's end to a reply thread taking it up (InferRequest::
  // reply_wait_seconds); part of the time outside batches.
  double reply_wait_seconds = 0;
};

// One request that left the queue (to run, or dropped as expired/cancelled).
struct DequeueRecord {
  double queue_seconds = 0;
};

// One batch executed by a backend. compute_seconds runs from handing the
// batch to the backend to its completion; input_seconds and output_seconds
// are the parts of it the backend spent moving tensors in and out
// (BatchTimings), the rest is inference.
struct BatchRecord {
  int64_t requests = 0;
  int64_t tokens = 0;
  double compute_seconds = 0;
  bool ok = true;
  double input_seconds = 0;
  double output_seconds = 0;
  std::string_view launch;  // BatchTimings::launch
  // Batch::expert_tokens (empty unless the span is a mixture of experts);
  // valid during the callback only.
  std::span<const int64_t> expert_tokens;

  double infer_seconds() const {
    const double rest = compute_seconds - input_seconds - output_seconds;
    return rest > 0 ? rest : 0;
  }
};

class ServerObserver {
 public:
  virtual ~ServerObserver() = default;
  virtual void OnRequestFinished(const RequestRecord&) {}
  virtual void OnDequeued(const DequeueRecord&) {}
  virtual void OnBatchExecuted(const BatchRecord&) {}
  virtual void OnQueueDepth(int64_t /*requests*/) {}
  // Requests accepted by the edge and not yet answered.
  virtual void OnInflight(int64_t /*requests*/) {}
  // The session table as it stands, after every change the batcher makes to
  // it (steps begun and finished, idle sessions freed).
  virtual void OnSessions(const SessionTableStats& /*stats*/) {}
};

// Forwards every callback to each of a fixed list of observers.
class ObserverList final : public ServerObserver {
 public:
  void Add(ServerObserver* observer) { observers_.push_back(observer); }  // before serving
  void OnRequestFinished(const RequestRecord& r) override {
    for (auto* o : observers_) o->OnRequestFinished(r);
  }
  void OnDequeued(const DequeueRecord& r) override {
    for (auto* o : observers_) o->OnDequeued(r);
  }
  void OnBatchExecuted(const BatchRecord& r) override {
    for (auto* o : observers_) o->OnBatchExecuted(r);
  }
  void OnQueueDepth(int64_t n) override {
    for (auto* o : observers_) o->OnQueueDepth(n);
  }
  void OnInflight(int64_t n) override {
    for (auto* o : observers_) o->OnInflight(n);
  }
  void OnSessions(const SessionTableStats& s) override {
    for (auto* o : observers_) o->OnSessions(s);
  }

 private:
  std::vector<ServerObserver*> observers_;  // not owned
};

}  // namespace layerserve
