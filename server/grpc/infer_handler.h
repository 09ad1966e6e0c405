// One ModelInfer request's path through the edge, shared by the unary RPC and
// ModelStreamInfer: check the model and readiness, validate and convert,
// check the x-session-id header against the sequence_id (session_header.h),
// while draining let only steps of open sessions in (server/core/drain.h),
// enqueue on the Batcher, and when the core is done build the response, check
// its size, report the outcome to the observer and reply.
//
// Threading: Submit() runs on a completion-queue thread (completion_queues.h)
// and never blocks (the batcher's Enqueue only takes its queue lock). The reply runs on that same
// thread when the request is rejected up front, otherwise on the batcher's or backend's completion
// thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpc_service.pb.h"
#include "grpcpp/server_context.h"
#include "server/core/batcher.h"
#include "server/core/clock.h"
#include "server/core/observer.h"
#include "server/core/validation.h"
#include "server/grpc/served_model.h"
#include "server/grpc/serving_state.h"

namespace layerserve {

class InferHandler {
 public:
  // Called exactly once per Submit with the outcome; on OK the response has
  // been filled. Nothing in the handler touches the request, the response or
  // the context after calling it.
  using Reply = std::function<void(const absl::Status&)>;

  // All pointers must outlive the handler, and the handler every request
  // submitted to it. `max_reply_bytes`: the largest serialized
  // ModelInferResponse the transport will send.
  InferHandler(const ServedModel& model, Batcher* batcher, ServerObserver* observer,
               const ServingState* state, size_t max_reply_bytes);

  InferHandler(const InferHandler&) = delete;
  InferHandler& operator=(const InferHandler&) = delete;

  // `context`, `request` and `response` must stay valid until `reply` runs;
  // the core reads the tensor straight out of `request`. `is_cancelled`
  // (called while the request waits in the queue, from the batcher's thread)
  // tells whether the client has gone: a flag that the call's "done"
  // notification sets.
  void Submit(const grpc::ServerContextBase& context, std::function<bool()> is_cancelled,
              const inference::ModelInferRequest* request, inference::ModelInferResponse* response,
              Reply reply);

  // A request whose bytes do not parse as a ModelInferRequest: reported as a
  // request of no model with `why`'s code (INVALID_ARGUMENT), then replied.
  void RefuseUnparsed(const absl::Status& why, const Reply& reply);

 private:
  // Reports a request that names no model this server serves (or none it
  // could read) as a request of no model, then replies with `status`: never
  // accepted, so never in flight either.
  void RefuseUnserved(const absl::Status& status, SteadyTime receipt, const Reply& reply);
  // Reports the finished request, then replies. `ran`: the request's
  // InferRequest, for its compute and reply-wait times (null when it never
  // ran).
  void Complete(const Reply& reply, const absl::Status& status, SteadyTime receipt, int64_t tokens,
                const InferRequest* ran = nullptr);
  void AddInflight(int64_t delta);

  const ServedModel& model_;
  const ModelLimits limits_;
  Batcher* const batcher_;
  ServerObserver* const observer_;
  const ServingState* const state_;
  const size_t max_reply_bytes_;

  // Held only to report the count in the order it changes.
  absl::Mutex inflight_mu_;
  int64_t inflight_ ABSL_GUARDED_BY(inflight_mu_) = 0;
};

}  // namespace layerserve
