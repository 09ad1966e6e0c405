// One ModelStreamInfer call on the completion-queue API (completion_queues.h).
//
// Reads requests one after another, submits each as it arrives (so a stream
// keeps many requests in the batcher at once), and writes the replies in the
// order the requests were read, as Triton does for a non-decoupled model:
// a reply that is ready waits for the replies of every earlier request of
// the stream. Errors for one request (refused up front or failed later)
// travel in error_message, take their request's place in that order, and
// leave the stream open. The call finishes once the client
// has half-closed (or gone) and every submitted request has been answered:
// the requests' tensors live in this object, so it must outlive them.
//
// Ordering guarantee: the requests of one stream reach the batcher in the
// order the client sent them. Each is submitted (validated and enqueued, or
// refused) before the next read is started, and reads complete on the
// stream's queue one at a time, so request k+1 cannot overtake request k. A
// client may thus pipeline a session's steps on one stream and have them
// enqueued in order (whether a step may be enqueued while an earlier one of
// its session is still in flight is the batcher's and the session table's
// business). Replies come back in the same order, so a client may match
// them by position (tritonclient's sequence stream example does) as well as
// by request id. Separate calls (unary ModelInfer, or two streams) are not
// ordered with respect to each other.
//
// A message that does not parse as a ModelInferRequest (the method is raw:
// inference_async_service.h) gets INVALID_ARGUMENT in error_message at its
// place in the order, is counted as a refused request, and leaves the stream
// open, as any other request's error does.
//
// Backpressure: a stream holds at most kMaxUnwritten requests (or
// kMaxUnwrittenBytes of them) whose replies are not yet written. Past that it
// stops reading until the client takes replies and the backlog is half gone;
// HTTP/2 flow control then holds the client's writes back. A client that
// never reads its replies thus costs the server a bounded amount, not every
// request it manages to send (issue 40, finding 1); one that pipelines more
// than the bound must read while it writes, as tritonclient's stream does.
#pragma once

#include <atomic>
#include <deque>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpc_service.grpc.pb.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/async_stream.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/completion_queues.h"
#include "server/grpc/infer_handler.h"
#include "server/grpc/inference_async_service.h"
#include "server/grpc/serving_state.h"

namespace layerserve {

class StreamInferCall {
 public:
  // What the stream calls share; must outlive every call.
  struct Deps {
    InferenceAsyncService* service;
    InferHandler* infer;
    ServingState* state;  // counts open streams
    const CallAuthenticator* auth;
    CompletionQueues* queues;
  };
  // Calls each queue keeps requested.
  static constexpr int kCallsPerQueue = 4;
  // The stream's backlog bound (see above).
  static constexpr size_t kMaxUnwritten = 16;
  static constexpr size_t kMaxUnwrittenBytes = size_t{8} << 20;

  // Requests one call on queue q.
  static void Await(const Deps& deps, int q);

  StreamInferCall(const StreamInferCall&) = delete;
  StreamInferCall& operator=(const StreamInferCall&) = delete;

 private:
  // A request read from the stream and its eventual response. `answered` is
  // set (under mu_) once the response is final; until then only the core and
  // Answer touch the request and response.
  struct Pending {
    std::unique_ptr<inference::ModelInferRequest> request;
    inference::ModelStreamInferResponse response;
    bool answered = false;
    size_t bytes = 0;  // the request's size as read: its share of the backlog
  };

  StreamInferCall(const Deps& deps, int q);

  void Accepted(bool ok);
  void ReadDone(bool ok);
  void WriteDone(bool ok);
  void Finished(bool ok);
  void Done(bool ok);
  // Runs once per submitted request, on any thread.
  void Answer(Pending* raw_pending, const absl::Status& status);
  // True exactly once: when the client has stopped sending and every answer
  // has been written (or dropped). Each event decides this in the same
  // critical section that changes the state, so exactly one of them
  // finishes and no write is outstanding when it does.
  bool ShouldFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts the next write if none is outstanding and the oldest request's
  // answer is ready: returns the response to write (null: nothing to write
  // now). Once the stream is broken, drops answered requests at the front
  // instead.
  const inference::ModelStreamInferResponse* NextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the backlog (in_order_ and writing_) is at its bound.
  bool BacklogFullLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // True once per pause, when reading was paused and the backlog has fallen
  // to half its bound (or the client can no longer be written to): the
  // caller then starts the next read, outside the lock.
  bool ShouldResumeReadingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartRead();
  // Writes `response` (the one outstanding write), as bytes.
  void StartWrite(const inference::ModelStreamInferResponse& response);
  void Release();

  const Deps& deps_;
  const int queue_;
  grpc::ServerContext context_;
  grpc::ServerAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer> stream_;
  // Only touched by StartRead and ReadDone, and reads never overlap (a
  // paused stream has none outstanding).
  grpc::ByteBuffer reading_;
  // The outstanding write's bytes (one at a time).
  grpc::ByteBuffer written_;
  bool opened_ = false;  // counted as an open stream (set before any read)
  std::atomic<bool> cancelled_{false};
  std::atomic<int> outstanding_{2};  // of an accepted call: finished and done

  absl::Mutex mu_;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // The response being written (gRPC allows one outstanding write), and
  // every request read but not yet written, in the order they were read
  // (answered or not): the stream's reorder buffer.
  std::unique_ptr<Pending> writing_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<Pending>> in_order_ ABSL_GUARDED_BY(mu_);
  size_t backlog_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of in_order_ and writing_
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;

  MemberOp<StreamInferCall> accepted_op_{this, &StreamInferCall::Accepted};
  MemberOp<StreamInferCall> read_op_{this, &StreamInferCall::ReadDone};
  MemberOp<StreamInferCall> write_op_{this, &StreamInferCall::WriteDone};
  MemberOp<StreamInferCall> finish_op_{this, &StreamInferCall::Finished};
  MemberOp<StreamInferCall> done_op_{this, &StreamInferCall::Done};
};

}  // namespace layerserve
