// inference.GRPCInferenceService: the health and metadata RPCs answer inline
// on gRPC's callback API; ModelStreamInfer (callback API too) and unary
// ModelInfer (the completion-queue API, async_infer.h) hand each request to
// the InferHandler and reply from its completion. Every RPC first
// asks the CallAuthenticator (--auth-token-file), which refuses a call
// without the token (UNAUTHENTICATED) unless --auth-open leaves it open.
//
// Every reaction returns without blocking: nothing here waits on compute, and
// the only lock (a stream's write queue) guards a few pointer moves.
#pragma once

#include <string>

#include "grpc_service.grpc.pb.h"
#include "server/core/stats.h"
#include "server/grpc/async_infer.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/infer_handler.h"
#include "server/grpc/served_model.h"
#include "server/grpc/serving_state.h"

namespace layerserve {

class InferenceService final : public InferenceServiceBase {
 public:
  // All pointers must outlive the service (and the gRPC server it is
  // registered with).
  InferenceService(const ServedModel& model, std::string server_version, ServingState* state,
                   InferHandler* infer, const StatsRecorder* stats, const CallAuthenticator* auth);

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* request,
                                       inference::ServerLiveResponse* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* request,
                                        inference::ServerReadyResponse* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* request,
                                           inference::ServerMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* context,
                                        const inference::ModelConfigRequest* request,
                                        inference::ModelConfigResponse* response) override;
  grpc::ServerUnaryReactor* ModelStatistics(grpc::CallbackServerContext* context,
                                            const inference::ModelStatisticsRequest* request,
                                            inference::ModelStatisticsResponse* response) override;
  grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>*
  ModelStreamInfer(grpc::CallbackServerContext* context) override;

 private:
  const ServedModel& model_;
  const std::string server_version_;
  ServingState* const state_;  // also counts open streams
  InferHandler* const infer_;
  const StatsRecorder* const stats_;
  const CallAuthenticator* const auth_;
};

}  // namespace layerserve
