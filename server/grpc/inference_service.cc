// GRPCInferenceService RPCs (see inference_service.h).
#include "server/grpc/inference_service.h"

#include <utility>

#include "server/grpc/model_info.h"

namespace layerserve {
namespace {

// The request function of a generated RequestX method of `service`, in the
// form UnaryMethod keeps.
template <typename Service, typename Base, typename Request, typename Response>
auto Requester(Service* service, void (Base::*request_x)(grpc::ServerContext*, Request*,
                                                         grpc::ServerAsyncResponseWriter<Response>*,
                                                         grpc::CompletionQueue*,
                                                         grpc::ServerCompletionQueue*, void*)) {
  return [service, request_x](grpc::ServerContext* context, Request* request,
                              grpc::ServerAsyncResponseWriter<Response>* writer,
                              grpc::ServerCompletionQueue* cq, void* tag) {
    (service->*request_x)(context, request, writer, cq, cq, tag);
  };
}

// A handler that answers at once: the auth check for `rpc`, then `answer`
// (which fills the response and returns the call's status).
template <typename Call, typename Answer>
std::function<void(Call&)> AnswerNow(const CallAuthenticator* auth, AuthRpc rpc, Answer answer) {
  return [auth, rpc, answer = std::move(answer)](Call& call) {
    if (absl::Status refused = auth->Check(call.context(), rpc); !refused.ok()) {
      return call.Reply(refused);
    }
    call.Reply(answer(call.request(), call.response()));
  };
}

}  // namespace

InferenceService::InferenceService(const ServedModel& model, std::string server_version,
                                   ServingState* state, InferHandler* infer,
                                   const StatsRecorder* stats, const CallAuthenticator* auth,
                                   CompletionQueues* queues)
    : model_(model),
      server_version_(std::move(server_version)),
      state_(state),
      infer_(infer),
      stats_(stats),
      auth_(auth),
      queues_(queues),
      stream_deps_{&service_, infer, state, auth, queues} {
  server_live_ = {Requester(&service_, &Service::RequestServerLive),
                  AnswerNow<decltype(server_live_)::Call>(
                      auth_, AuthRpc::kLive,
                      [](const inference::ServerLiveRequest&, inference::ServerLiveResponse* r) {
                        // Answering at all is the proof of life; draining does not change it.
                        r->set_live(true);
                        return absl::OkStatus();
                      })};
  server_ready_ = {
      Requester(&service_, &Service::RequestServerReady),
      AnswerNow<decltype(server_ready_)::Call>(
          auth_, AuthRpc::kReady,
          [this](const inference::ServerReadyRequest&, inference::ServerReadyResponse* r) {
            r->set_ready(state_->Readiness().ok());
            return absl::OkStatus();
          })};
  model_ready_ = {
      Requester(&service_, &Service::RequestModelReady),
      AnswerNow<decltype(model_ready_)::Call>(
          auth_, AuthRpc::kReady,
          [this](const inference::ModelReadyRequest& q, inference::ModelReadyResponse* r) {
            // As Triton does: an unknown model is "not ready", not an error,
            // so tritonclient's is_model_ready() returns False instead of
            // raising.
            const absl::Status known = CheckModel(model_, q.name(), q.version());
            r->set_ready(known.ok() && state_->Readiness().ok());
            return absl::OkStatus();
          })};
  server_metadata_ = {
      Requester(&service_, &Service::RequestServerMetadata),
      AnswerNow<decltype(server_metadata_)::Call>(
          auth_, AuthRpc::kMetadata,
          [this](const inference::ServerMetadataRequest&, inference::ServerMetadataResponse* r) {
            FillServerMetadata(server_version_, r);
            return absl::OkStatus();
          })};
  model_metadata_ = {
      Requester(&service_, &Service::RequestModelMetadata),
      AnswerNow<decltype(model_metadata_)::Call>(
          auth_, AuthRpc::kMetadata,
          [this](const inference::ModelMetadataRequest& q, inference::ModelMetadataResponse* r) {
            const absl::Status known = CheckModel(model_, q.name(), q.version());
            if (known.ok()) FillModelMetadata(model_, r);
            return known;
          })};
  model_config_ = {
      Requester(&service_, &Service::RequestModelConfig),
      AnswerNow<decltype(model_config_)::Call>(
          auth_, AuthRpc::kMetadata,
          [this](const inference::ModelConfigRequest& q, inference::ModelConfigResponse* r) {
            const absl::Status known = CheckModel(model_, q.name(), q.version());
            if (known.ok()) FillModelConfig(model_, r->mutable_config());
            return known;
          })};
  model_statistics_ = {Requester(&service_, &Service::RequestModelStatistics),
                       AnswerNow<decltype(model_statistics_)::Call>(
                           auth_, AuthRpc::kStatistics,
                           [this](const inference::ModelStatisticsRequest& q,
                                  inference::ModelStatisticsResponse* r) {
                             // An empty name asks for every model; this server has one.
                             if (!q.name().empty() || !q.version().empty()) {
                               const absl::Status known = CheckModel(model_, q.name(), q.version());
                               if (!known.ok()) return known;
                             }
                             FillModelStatistics(model_, stats_->Snapshot(), r->add_model_stats());
                             return absl::OkStatus();
                           })};
  model_infer_ = {Requester(&service_, &Service::RequestModelInfer),
                  [this](decltype(model_infer_)::Call& call) {
                    if (absl::Status refused = auth_->Check(call.context(), AuthRpc::kInference);
                        !refused.ok()) {
                      return call.Reply(refused);
                    }
                    // The call keeps its request until it has replied, which is what
                    // lets the core read the tensor in place.
                    infer_->Submit(
                        call.context(), [&call] { return call.cancelled(); }, &call.request(),
                        call.response(),
                        [&call](const absl::Status& status) { call.Reply(status); });
                  },
                  kInferCallsPerQueue};
}

void InferenceService::RequestCalls(int q) {
  server_live_.RequestCalls(*queues_, q);
  server_ready_.RequestCalls(*queues_, q);
  model_ready_.RequestCalls(*queues_, q);
  server_metadata_.RequestCalls(*queues_, q);
  model_metadata_.RequestCalls(*queues_, q);
  model_config_.RequestCalls(*queues_, q);
  model_statistics_.RequestCalls(*queues_, q);
  model_infer_.RequestCalls(*queues_, q);
  for (int i = 0; i < StreamInferCall::kCallsPerQueue; ++i) StreamInferCall::Await(stream_deps_, q);
}

}  // namespace layerserve
