// inference.GRPCInferenceService on gRPC's completion-queue API
// (completion_queues.h): the health and metadata RPCs answer on the queue's
// thread; ModelInfer and ModelStreamInfer hand each request to the
// InferHandler and reply from its completion. Every RPC first asks the
// CallAuthenticator (--auth-token-file), which refuses a call without the
// token (UNAUTHENTICATED) unless --auth-open leaves it open.
//
// Every handler returns without blocking: nothing here waits on compute, and
// the only lock (a stream's write queue) guards a few pointer moves.
#pragma once

#include <string>

#include "grpc_service.grpc.pb.h"
#include "server/core/stats.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/completion_queues.h"
#include "server/grpc/infer_handler.h"
#include "server/grpc/inference_async_service.h"
#include "server/grpc/served_model.h"
#include "server/grpc/serving_state.h"
#include "server/grpc/stream_infer_call.h"
#include "server/grpc/unary_call.h"

namespace layerserve {

// ModelInfer calls each queue keeps requested, so a burst of arrivals finds
// one waiting (the other RPCs keep one each).
inline constexpr int kInferCallsPerQueue = 16;

class InferenceService {
 public:
  // All pointers must outlive the service (and the gRPC server it is
  // registered with).
  InferenceService(const ServedModel& model, std::string server_version, ServingState* state,
                   InferHandler* infer, const StatsRecorder* stats, const CallAuthenticator* auth,
                   CompletionQueues* queues);

  InferenceService(const InferenceService&) = delete;
  InferenceService& operator=(const InferenceService&) = delete;

  // The generated service, for ServerBuilder::RegisterService.
  grpc::Service* service() { return &service_; }
  // Requests each RPC's first calls on queue q (CompletionQueues::Start).
  void RequestCalls(int q);

 private:
  using Service = InferenceAsyncService;
  template <typename Request, typename Response, bool kRaw = false>
  using Method = UnaryMethod<Request, Response, kRaw>;

  const ServedModel& model_;
  const std::string server_version_;
  ServingState* const state_;
  InferHandler* const infer_;
  const StatsRecorder* const stats_;
  const CallAuthenticator* const auth_;
  CompletionQueues* const queues_;
  Service service_;

  Method<inference::ServerLiveRequest, inference::ServerLiveResponse, /*kRaw=*/true> server_live_;
  Method<inference::ServerReadyRequest, inference::ServerReadyResponse, /*kRaw=*/true>
      server_ready_;
  Method<inference::ModelReadyRequest, inference::ModelReadyResponse, /*kRaw=*/true> model_ready_;
  Method<inference::ServerMetadataRequest, inference::ServerMetadataResponse, /*kRaw=*/true>
      server_metadata_;
  Method<inference::ModelMetadataRequest, inference::ModelMetadataResponse, /*kRaw=*/true>
      model_metadata_;
  Method<inference::ModelConfigRequest, inference::ModelConfigResponse, /*kRaw=*/true>
      model_config_;
  Method<inference::ModelStatisticsRequest, inference::ModelStatisticsResponse, /*kRaw=*/true>
      model_statistics_;
  Method<inference::RepositoryIndexRequest, inference::RepositoryIndexResponse, /*kRaw=*/true>
      repository_index_;
  Method<inference::ModelInferRequest, inference::ModelInferResponse, /*kRaw=*/true> model_infer_;
  StreamInferCall::Deps stream_deps_;
};

}  // namespace layerserve
