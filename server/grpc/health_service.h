// grpc.health.v1.Health on the completion-queue API (completion_queues.h),
// answered from the live serving state rather than gRPC's default service
// (whose status would have to be pushed on every change of backend health).
// "" is the whole server; the inference service's full name is accepted too.
// Watch is not implemented (UNIMPLEMENTED, which the protocol tells clients
// to treat as "not supported").
#pragma once

#include "grpc/health/v1/health.grpc.pb.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/completion_queues.h"
#include "server/grpc/serving_state.h"
#include "server/grpc/unary_call.h"

namespace layerserve {

class HealthService {
 public:
  // All pointers must outlive the service and the server it is registered
  // with.
  HealthService(const ServingState* state, const CallAuthenticator* auth, CompletionQueues* queues);

  HealthService(const HealthService&) = delete;
  HealthService& operator=(const HealthService&) = delete;

  // The generated service, for ServerBuilder::RegisterService.
  grpc::Service* service() { return &service_; }
  // Requests the first Check and Watch calls on queue q.
  void RequestCalls(int q);

 private:
  grpc::health::v1::Health::AsyncService service_;
  CompletionQueues* const queues_;
  UnaryMethod<grpc::health::v1::HealthCheckRequest, grpc::health::v1::HealthCheckResponse> check_;
};

}  // namespace layerserve
