// GRPCInferenceService RPCs (see inference_service.h).
#include "server/grpc/inference_service.h"

#include <deque>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/grpc/model_info.h"
#include "server/grpc/status_convert.h"

namespace layerserve {
namespace {

using inference::ModelInferRequest;
using inference::ModelStreamInferResponse;

grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* context,
                                    const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// One ModelStreamInfer call. Reads requests one after another, submits each
// as it arrives (so a stream keeps many requests in the batcher at once), and
// writes each reply when it is ready, in completion order. Errors for one
// request travel in error_message and leave the stream open. The call
// finishes once the client has half-closed (or gone) and every submitted
// request has been answered: the requests' tensors live in this reactor, so
// it must outlive them.
//
// Ordering guarantee: the requests of one stream reach the batcher in the
// order the client sent them. Each is submitted (validated and enqueued, or
// refused) before the next read is started, so request k+1 cannot overtake
// request k, whichever gRPC threads run the reactions. A client may thus
// pipeline a session's steps on one stream and have them enqueued in order
// (whether a step may be enqueued while an earlier one of its session is
// still in flight is the batcher's and the session table's business).
// Replies carry no such guarantee: they are written as requests complete,
// and the client matches them by request id. Separate calls (unary
// ModelInfer, or two streams) are not ordered with respect to each other.
class StreamInferReactor final
    : public grpc::ServerBidiReactor<ModelInferRequest, ModelStreamInferResponse> {
 public:
  StreamInferReactor(grpc::CallbackServerContext* context, InferHandler* infer, ServingState* state)
      : context_(context),
        infer_(infer),
        state_(state),
        reading_(std::make_unique<ModelInferRequest>()) {
    state_->StreamOpened();
    StartRead(reading_.get());
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-close, cancellation or a broken connection
      bool finish = false;
      {
        absl::MutexLock lock(&mu_);
        reads_done_ = true;
        finish = ShouldFinishLocked();
      }
      if (finish) Finish(grpc::Status::OK);
      return;
    }
    auto* call = new Call{std::move(reading_), {}};
    {
      absl::MutexLock lock(&mu_);
      ++unanswered_;  // keeps the reactor alive until Answer
    }
    // Submit before the next read starts: OnReadDone of that read may run on
    // another thread as soon as it is started, and must find this request
    // already in the batcher's queue (the ordering guarantee above). Submit
    // never blocks; the reactor cannot finish in between, since reads are
    // not done.
    infer_->Submit(
        *context_, [context = context_] { return context->IsCancelled(); }, call->request.get(),
        call->response.mutable_infer_response(),
        [this, call](const absl::Status& status) { Answer(call, status); });
    reading_ = std::make_unique<ModelInferRequest>();
    StartRead(reading_.get());
  }

  void OnWriteDone(bool ok) override {
    const ModelStreamInferResponse* next = nullptr;
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      writing_.reset();
      if (!ok) {
        broken_ = true;  // the client is gone: later answers are dropped
        pending_writes_.clear();
      } else if (!pending_writes_.empty()) {
        writing_ = std::move(pending_writes_.front());
        pending_writes_.pop_front();
        next = &writing_->response;
      }
      finish = ShouldFinishLocked();
    }
    if (next != nullptr) StartWrite(next);
    if (finish) Finish(grpc::Status::OK);
  }

  void OnDone() override {
    state_->StreamClosed();
    delete this;
  }

 private:
  // A request read from the stream and its eventual response.
  struct Call {
    std::unique_ptr<ModelInferRequest> request;
    ModelStreamInferResponse response;
  };

  // Runs once per submitted request, on any thread.
  void Answer(Call* raw_call, const absl::Status& status) {
    std::unique_ptr<Call> call(raw_call);
    if (!status.ok()) {
      auto* infer_response = call->response.mutable_infer_response();
      infer_response->Clear();
      // The id lets the client tell which of its requests failed.
      infer_response->set_id(call->request->id());
      infer_response->set_model_name(call->request->model_name());
      call->response.set_error_message(StreamErrorMessage(status));
    }
    call->request.reset();  // the core is done with the tensor
    const ModelStreamInferResponse* write = nullptr;
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      --unanswered_;
      if (broken_) {
        call.reset();
      } else if (writing_ == nullptr) {
        writing_ = std::move(call);
        write = &writing_->response;
      } else {
        pending_writes_.push_back(std::move(call));
      }
      finish = ShouldFinishLocked();
    }
    if (write != nullptr) StartWrite(write);
    if (finish) Finish(grpc::Status::OK);
  }

  // True exactly once: when the client has stopped sending and every answer
  // has been written (or dropped). Each reaction decides this in the same
  // critical section that changes the state, so exactly one of them finishes
  // and none touches the reactor afterwards: OnDone, which deletes it, may
  // follow Finish at once.
  bool ShouldFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || !reads_done_ || unanswered_ > 0 || writing_ != nullptr ||
        !pending_writes_.empty()) {
      return false;
    }
    finished_ = true;
    return true;
  }

  grpc::CallbackServerContext* const context_;
  InferHandler* const infer_;
  ServingState* const state_;
  // Only touched by OnReadDone, and reads never overlap.
  std::unique_ptr<ModelInferRequest> reading_;

  absl::Mutex mu_;
  int64_t unanswered_ ABSL_GUARDED_BY(mu_) = 0;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // The response being written (gRPC allows one outstanding write) and those
  // waiting their turn.
  std::unique_ptr<Call> writing_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<Call>> pending_writes_ ABSL_GUARDED_BY(mu_);
};

// A ModelStreamInfer call refused as it opens: finished at once, nothing
// read.
class RefusedStreamReactor final
    : public grpc::ServerBidiReactor<ModelInferRequest, ModelStreamInferResponse> {
 public:
  explicit RefusedStreamReactor(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

InferenceService::InferenceService(const ServedModel& model, std::string server_version,
                                   ServingState* state, InferHandler* infer,
                                   const StatsRecorder* stats, const CallAuthenticator* auth)
    : model_(model),
      server_version_(std::move(server_version)),
      state_(state),
      infer_(infer),
      stats_(stats),
      auth_(auth) {}

grpc::ServerUnaryReactor* InferenceService::ServerLive(grpc::CallbackServerContext* context,
                                                       const inference::ServerLiveRequest*,
                                                       inference::ServerLiveResponse* response) {
  if (absl::Status refused = auth_->Check(*context, AuthRpc::kLive); !refused.ok()) {
    return FinishNow(context, refused);
  }
  // Answering at all is the proof of life; draining does not change it.
  response->set_live(true);
  return FinishNow(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ServerReady(grpc::CallbackServerContext* context,
                                                        const inference::ServerReadyRequest*,
                                                        inference::ServerReadyResponse* response) {
  if (absl::Status refused = auth_->Check(*context, AuthRpc::kReady); !refused.ok()) {
    return FinishNow(context, refused);
  }
  response->set_ready(state_->Readiness().ok());
  return FinishNow(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ModelReady(grpc::CallbackServerContext* context,
                                                       const inference::ModelReadyRequest* request,
                                                       inference::ModelReadyResponse* response) {
  if (absl::Status refused = auth_->Check(*context, AuthRpc::kReady); !refused.ok()) {
    return FinishNow(context, refused);
  }
  // As Triton does: an unknown model is "not ready", not an error, so
  // tritonclient's is_model_ready() returns False instead of raising.
  const absl::Status known = CheckModel(model_, request->name(), request->version());
  response->set_ready(known.ok() && state_->Readiness().ok());
  return FinishNow(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* response) {
  if (absl::Status refused = auth_->Check(*context, AuthRpc::kMetadata); !refused.ok()) {
    return FinishNow(context, refused);
  }
  FillServerMetadata(server_version_, response);
  return FinishNow(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  if (absl::Status refused = auth_->Check(*context, AuthRpc::kMetadata); !refused.ok()) {
    return FinishNow(context, refused);
  }
  const absl::Status known = CheckModel(model_, request->name(), request->version());
  if (known.ok()) FillModelMetadata(model_, response);
  return FinishNow(context, known);
}

grpc::ServerUnaryReactor* InferenceService::ModelConfig(
    grpc::CallbackServerContext* context, const inference::ModelConfigRequest* request,
    inference::ModelConfigResponse* response) {
  if (absl::Status refused = auth_->Check(*context, AuthRpc::kMetadata); !refused.ok()) {
    return FinishNow(context, refused);
  }
  const absl::Status known = CheckModel(model_, request->name(), request->version());
  if (known.ok()) FillModelConfig(model_, response->mutable_config());
  return FinishNow(context, known);
}

grpc::ServerUnaryReactor* InferenceService::ModelStatistics(
    grpc::CallbackServerContext* context, const inference::ModelStatisticsRequest* request,
    inference::ModelStatisticsResponse* response) {
  if (absl::Status refused = auth_->Check(*context, AuthRpc::kStatistics); !refused.ok()) {
    return FinishNow(context, refused);
  }
  // An empty name asks for every model; this server has one.
  if (!request->name().empty() || !request->version().empty()) {
    const absl::Status known = CheckModel(model_, request->name(), request->version());
    if (!known.ok()) return FinishNow(context, known);
  }
  FillModelStatistics(model_, stats_->Snapshot(), response->add_model_stats());
  return FinishNow(context, absl::OkStatus());
}

grpc::ServerBidiReactor<ModelInferRequest, ModelStreamInferResponse>*
InferenceService::ModelStreamInfer(grpc::CallbackServerContext* context) {
  // Refused before the first read: no request of an unauthenticated stream
  // is received.
  if (absl::Status refused = auth_->Check(*context, AuthRpc::kInference); !refused.ok()) {
    return new RefusedStreamReactor(refused);
  }
  return new StreamInferReactor(context, infer_, state_);
}

}  // namespace layerserve
