// The gRPC server's completion queues and the threads that poll them: every
// RPC of the server runs on gRPC's completion-queue API.
//
// Why not the callback API: gRPC 1.51 runs callback reactions on its own
// "nexting" threads, which take each event from a completion queue that the
// polling threads filled, so a call crosses a thread before its handler runs,
// and it allocates a call for every stream a client opens, even one reset at
// once (the HTTP/2 rapid-reset flood: +0.9 GB for 50 000 streams). Here each
// thread owns one queue, polls the sockets and runs the handlers itself, as
// gRPC's own fastest benchmarks and Triton's server do; a stream reset before
// one of the server's requested calls takes it is dropped with nothing
// allocated, as long as the threads keep up. It served the same tokens/s as
// the callback API with 10-18% less server CPU per request. Design record
// 0001.
//
// The calls (unary_call.h, stream_infer_call.h) request themselves from gRPC
// ahead of arrivals, a few per queue; a call, once accepted, requests its
// successor first. Each event a call waits for has its own tag, an AsyncOp,
// which the queue's thread completes. Handlers run on that thread and never
// block; replies may be issued from any thread (the batcher's).
//
// Life cycle: AddTo() before the server is built, Start() after, Shutdown()
// after grpc::Server::Shutdown returned (no call open): it closes the queues
// and joins the threads once the queues have drained.
#pragma once

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/server_builder.h"

namespace layerserve {

// A completion-queue tag: what to do when its operation completes (`ok`:
// gRPC's success bit for it).
class AsyncOp {
 public:
  virtual void Complete(bool ok) = 0;

 protected:
  ~AsyncOp() = default;
};

// The tag that calls object->*method(ok).
template <typename T>
class MemberOp final : public AsyncOp {
 public:
  MemberOp(T* object, void (T::*method)(bool)) : object_(object), method_(method) {}
  void Complete(bool ok) override { (object_->*method_)(ok); }

 private:
  T* const object_;
  void (T::*const method_)(bool);
};

// A quarter of the machine's cores, at least 2 and at most 8: the threads
// only parse, validate and enqueue (compute and replies run elsewhere).
int DefaultQueueThreads();

class CompletionQueues {
 public:
  explicit CompletionQueues(int threads);  // threads >= 1
  ~CompletionQueues();                     // Shutdown()

  CompletionQueues(const CompletionQueues&) = delete;
  CompletionQueues& operator=(const CompletionQueues&) = delete;

  int size() const { return static_cast<int>(queues_.size()); }

  // Adds the queues to `builder`; before BuildAndStart.
  void AddTo(grpc::ServerBuilder& builder);
  // Calls request_calls(q) for each queue, to request its first calls, then
  // starts the threads; after BuildAndStart.
  void Start(const std::function<void(int)>& request_calls);
  // Runs request(queue q) unless Shutdown() has begun: gRPC takes no new
  // request on a queue being shut down.
  void Request(int q, absl::FunctionRef<void(grpc::ServerCompletionQueue*)> request);
  // Closes the queues and joins the threads once the queues are drained.
  // Call after the server's Shutdown() returned; idempotent.
  void Shutdown();

 private:
  void Poll(int q);

  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues_;
  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace layerserve
