// Unary ModelInfer on gRPC's completion-queue API, the request path that
// carries most of the traffic; every other RPC stays on the callback API.
//
// Why not the callback API for this one: gRPC 1.51 runs callback reactions
// on its own "nexting" threads, which take each event from a completion queue
// that the polling threads filled, so a call crosses a thread before the
// handler sees it. Here each of `threads` threads owns one completion queue
// and both polls the sockets and runs the handler, as gRPC's own fastest
// benchmarks and Triton's server do. Measured on the H100 machine (docs/
// perf.md, "The request path on the completion-queue API"): the same tokens/s,
// 10-18% less server CPU per request; and a stream reset before it is matched
// with a requested call costs no memory, where the callback API allocated a
// call for each (the rapid-reset flood).
//
// Each thread keeps kCallsPerQueue calls requested from gRPC, so a burst of
// arrivals finds one waiting; a call, once accepted, requests its successor
// first. A call's handler (auth, InferHandler::Submit) runs on its queue's
// thread and never blocks; the reply (Finish) is issued from whatever thread
// completes the request. A call object lives until both its Finish and its
// "done" notification (which also tells whether the client cancelled) are
// back from the queue.
//
// Life cycle: Start() after the server has been built with the queues that
// AddQueues() added; Shutdown() after grpc::Server::Shutdown returned, which
// closes the queues and joins the threads once they have drained.
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpc_service.grpc.pb.h"
#include "grpcpp/server_builder.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/infer_handler.h"

namespace layerserve {

// The inference service's generated base: ModelInfer on the completion-queue
// API, every other method on the callback API.
using InferenceServiceBase = inference::GRPCInferenceService::WithCallbackMethod_ServerLive<
    inference::GRPCInferenceService::WithCallbackMethod_ServerReady<
        inference::GRPCInferenceService::WithCallbackMethod_ModelReady<
            inference::GRPCInferenceService::WithCallbackMethod_ServerMetadata<
                inference::GRPCInferenceService::WithCallbackMethod_ModelMetadata<
                    inference::GRPCInferenceService::WithAsyncMethod_ModelInfer<
                        inference::GRPCInferenceService::WithCallbackMethod_ModelStreamInfer<
                            inference::GRPCInferenceService::WithCallbackMethod_ModelConfig<
                                inference::GRPCInferenceService::WithCallbackMethod_ModelStatistics<
                                    inference::GRPCInferenceService::Service>>>>>>>>>;

// Calls each queue keeps requested from gRPC ahead of arrivals.
inline constexpr int kCallsPerQueue = 16;

class AsyncInfer {
 public:
  // `service` must be registered with the builder; all pointers must outlive
  // this object. threads >= 1.
  AsyncInfer(InferenceServiceBase* service, InferHandler* infer, const CallAuthenticator* auth,
             int threads);
  ~AsyncInfer();  // Shutdown()

  AsyncInfer(const AsyncInfer&) = delete;
  AsyncInfer& operator=(const AsyncInfer&) = delete;

  // Adds this object's completion queues to `builder`; before BuildAndStart.
  void AddQueues(grpc::ServerBuilder& builder);
  // Requests the first calls and starts the threads; after BuildAndStart.
  void Start();
  // Closes the queues and joins the threads. Call after the server's
  // Shutdown() has returned (so no call is still open); idempotent.
  void Shutdown();

 private:
  class Call;
  // Requests one more call on queue `q`, unless shutting down.
  void RequestCall(int q);
  void Poll(int q);

  InferenceServiceBase* const service_;
  InferHandler* const infer_;
  const CallAuthenticator* const auth_;
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues_;
  std::vector<std::thread> threads_;
  const int num_threads_;

  // Held while requesting a call, so that no request reaches a queue after
  // Shutdown() has begun closing it.
  absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace layerserve
