// GRPCInferenceService RPCs (see inference_service.h).
#include "server/grpc/inference_service.h"

#include <utility>

#include "absl/strings/str_cat.h"

#include "server/grpc/model_info.h"

namespace layerserve {
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
  server_live_ = {RequestOf(&service_, &Service::RequestServerLive),
                  AnswerNow<decltype(server_live_)::Call>(
                      auth_, AuthRpc::kLive,
                      [](const inference::ServerLiveRequest&, inference::ServerLiveResponse* r) {
                        // Answering at all is the proof of life; draining does not change it.
                        r->set_live(true);
                        return absl::OkStatus();
                      })};
  server_ready_ = {
      RequestOf(&service_, &Service::RequestServerReady),
      AnswerNow<decltype(server_ready_)::Call>(
          auth_, AuthRpc::kReady,
          [this](const inference::ServerReadyRequest&, inference::ServerReadyResponse* r) {
            r->set_ready(state_->Readiness().ok());
            return absl::OkStatus();
          })};
  model_ready_ = {
      RequestOf(&service_, &Service::RequestModelReady),
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
      RequestOf(&service_, &Service::RequestServerMetadata),
      AnswerNow<decltype(server_metadata_)::Call>(
          auth_, AuthRpc::kMetadata,
          [this](const inference::ServerMetadataRequest&, inference::ServerMetadataResponse* r) {
            FillServerMetadata(server_version_, r);
            return absl::OkStatus();
          })};
  model_metadata_ = {
      RequestOf(&service_, &Service::RequestModelMetadata),
      AnswerNow<decltype(model_metadata_)::Call>(
          auth_, AuthRpc::kMetadata,
          [this](const inference::ModelMetadataRequest& q, inference::ModelMetadataResponse* r) {
            const absl::Status known = CheckModel(model_, q.name(), q.version());
            if (known.ok()) FillModelMetadata(model_, r);
            return known;
          })};
  model_config_ = {
      RequestOf(&service_, &Service::RequestModelConfig),
      AnswerNow<decltype(model_config_)::Call>(
          auth_, AuthRpc::kMetadata,
          [this](const inference::ModelConfigRequest& q, inference::ModelConfigResponse* r) {
            const absl::Status known = CheckModel(model_, q.name(), q.version());
            if (known.ok()) FillModelConfig(model_, r->mutable_config());
            return known;
          })};
  model_statistics_ = {RequestOf(&service_, &Service::RequestModelStatistics),
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
  repository_index_ = {
      RequestOf(&service_, &Service::RequestRepositoryIndex),
      AnswerNow<decltype(repository_index_)::Call>(
          auth_, AuthRpc::kMetadata,
          [this](const inference::RepositoryIndexRequest& q,
                 inference::RepositoryIndexResponse* r) {
            if (!q.repository_name().empty()) {
              return absl::NotFoundError(absl::StrCat("no model repository '", q.repository_name(),
                                                      "': this server serves one model, '",
                                                      model_.name, "' (repository_name \"\")"));
            }
            FillRepositoryIndex(model_, state_->Readiness(), q.ready(), r);
            return absl::OkStatus();
          })};
  model_infer_ = {RequestOf(&service_, &Service::RequestModelInfer),
                  [this](decltype(model_infer_)::Call& call) {
                    if (absl::Status refused = auth_->Check(call.context(), AuthRpc::kInference);
                        !refused.ok()) {
                      return call.Reply(refused);
                    }
                    const auto reply = [&call](const absl::Status& status) { call.Reply(status); };
                    if (!call.parsed().ok()) return infer_->RefuseUnparsed(call.parsed(), reply);
                    // The call keeps its request until it has replied, which is what
                    // lets the core read the tensor in place.
                    infer_->Submit(
                        call.context(), [&call] { return call.cancelled(); }, &call.request(),
                        call.response(), reply);
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
  repository_index_.RequestCalls(*queues_, q);
  model_infer_.RequestCalls(*queues_, q);
  for (int i = 0; i < StreamInferCall::kCallsPerQueue; ++i) StreamInferCall::Await(stream_deps_, q);
}

}  // namespace layerserve
