// Pieces shared by the two load generators of `layerctl bench`: the request
// bench (bench.h: independent requests, closed or open loop) and the session
// bench (session_bench.h: sessions of a prefill and decode steps). Internal
// to client/bench, which layerctl links; not part of the client library.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/tensor.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/support/async_unary_call.h"

namespace layerserve::client {

// One ModelInfer call of those loops on a completion queue: what must stay
// alive until its tag comes back, and when it was sent.
struct QueuedInfer {
  absl::Time issued;
  std::unique_ptr<grpc::ClientContext> context;
  std::unique_ptr<grpc::ClientAsyncResponseReader<inference::ModelInferResponse>> reader;
  inference::ModelInferResponse response;
  grpc::Status status;

  // Sends `request` (kept alive by the caller until `tag` comes back on
  // `cq`) through `client` at `sent`, due `timeout` after it.
  void Start(Client& client, const inference::ModelInferRequest& request, absl::Time sent,
             absl::Duration timeout, grpc::CompletionQueue* cq, void* tag);
  // Once the tag is back: the call's status, and when that is OK whether the
  // reply holds a well-formed output, as Infer checks. Checked in place, the
  // response keeps its buffers for the next reply, rather than a fresh 2 MiB
  // string (to be faulted in page by page) for every 128-token FP32 reply.
  absl::Status Outcome() const;
};

// Shuts a loop's completion queue down and drains what is left on it.
void ShutDownQueue(grpc::CompletionQueue& cq);

// The first fatal status any request got (IsFatalBenchStatus); once set,
// every loop stops issuing requests and waits that watch it end early.
// Thread-safe.
class FatalStop {
 public:
  void Set(const absl::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (!status_.ok()) return;
      status_ = status;
    }
    stopped_.Notify();
  }
  bool stopped() const { return stopped_.HasBeenNotified(); }
  // Waits until `deadline` or a stop, whichever comes first; true on a stop.
  bool WaitUntil(absl::Time deadline) const {
    return stopped_.WaitForNotificationWithDeadline(deadline);
  }
  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Notification stopped_;
};

// The status a bench returns for a fatal request status: same code and
// payloads (a call's status stays one, see IsCallStatus), the message says
// the run stopped.
absl::Status StoppedBy(const absl::Status& fatal);

// A live progress line on stderr: once a second, until destroyed, `line()`
// gives the text, which rewrites the line before it ("\r"); a newline ends
// it at destruction. Disabled, it starts no thread and prints nothing.
// `line` runs on the line's own thread.
class ProgressLine {
 public:
  ProgressLine(bool enabled, std::function<std::string()> line);
  ~ProgressLine();
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

 private:
  void Run();

  const std::function<std::string()> line_;
  absl::Notification stop_;
  std::thread thread_;
};

// INVALID_ARGUMENT naming --datatype unless it is FP32, FP16 or BF16.
absl::Status CheckBenchDatatype(const std::string& datatype);

// The model's hidden size, the last dimension of its "hidden_states" input
// in ModelMetadata (FAILED_PRECONDITION asking for --hidden if it states
// none); the call's own status on failure.
absl::StatusOr<int64_t> HiddenFromMetadata(Client& client, const std::string& model);

// `count` tensors of `shape` and `datatype` (FP32, FP16 or BF16) filled with
// standard normal values drawn from `seed`: up to kRandomInputPool of them
// per tensor, which a larger tensor repeats from random starting points.
inline constexpr size_t kRandomInputPool = size_t{1} << 20;
std::vector<Tensor> RandomInputs(const std::vector<int64_t>& shape, const std::string& datatype,
                                 uint64_t seed, size_t count);

// Counts a failed request's status under its code name ("RESOURCE_EXHAUSTED")
// in `counts`, and keeps its message in `first` if it is the code's first,
// so that a report says why requests failed, not only how often.
void CountError(const absl::Status& status, std::map<std::string, int64_t>& counts,
                std::map<std::string, std::string>& first);

// The report lines for `counts`: "errors CODE: N (first: message)\n" per
// code (without the parenthesis for a code with no message kept).
std::string FormatErrorLines(const std::map<std::string, int64_t>& counts,
                             const std::map<std::string, std::string>& first);

}  // namespace layerserve::client
