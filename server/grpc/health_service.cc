// grpc.health.v1.Health (see health_service.h).
#include "server/grpc/health_service.h"

#include "absl/strings/str_cat.h"
#include "base/echo.h"
#include "grpc_service.grpc.pb.h"
#include "grpcpp/support/async_stream.h"

namespace layerserve {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One Watch call: refused as it arrives.
class RefusedWatch {
 public:
  static void Await(grpc::health::v1::Health::AsyncService* service, CompletionQueues* queues,
                    int q) {
    queues->Request(q, [&](grpc::ServerCompletionQueue* cq) {
      auto* call = new RefusedWatch(service, queues, q);
      service->RequestWatch(&call->context_, &call->request_, &call->writer_, cq, cq,
                            &call->accepted_);
    });
  }

 private:
  RefusedWatch(grpc::health::v1::Health::AsyncService* service, CompletionQueues* queues, int q)
      : service_(service), queues_(queues), queue_(q), writer_(&context_) {}

  void Accepted(bool ok) {
    if (!ok) {  // shutting down, never matched with a call
      delete this;
      return;
    }
    Await(service_, queues_, queue_);
    writer_.Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "Watch is not implemented"),
                   &finished_);
  }
  void Finished(bool) { delete this; }

  grpc::health::v1::Health::AsyncService* const service_;
  CompletionQueues* const queues_;
  const int queue_;
  grpc::ServerContext context_;
  HealthCheckRequest request_;
  grpc::ServerAsyncWriter<HealthCheckResponse> writer_;
  MemberOp<RefusedWatch> accepted_{this, &RefusedWatch::Accepted};
  MemberOp<RefusedWatch> finished_{this, &RefusedWatch::Finished};
};

}  // namespace

HealthService::HealthService(const ServingState* state, const CallAuthenticator* auth,
                             CompletionQueues* queues)
    : queues_(queues) {
  check_.request = RequestOf(&service_, &grpc::health::v1::Health::AsyncService::RequestCheck);
  check_.handle = AnswerNow<decltype(check_)::Call>(
      auth, AuthRpc::kHealth,
      [state](const HealthCheckRequest& request, HealthCheckResponse* response) {
        const std::string& service = request.service();
        if (!service.empty() && service != inference::GRPCInferenceService::service_full_name()) {
          return absl::NotFoundError(
              absl::StrCat("unknown service '", EchoForMessage(service), "'"));
        }
        response->set_status(state->Readiness().ok() ? HealthCheckResponse::SERVING
                                                     : HealthCheckResponse::NOT_SERVING);
        return absl::OkStatus();
      });
}

void HealthService::RequestCalls(int q) {
  check_.RequestCalls(*queues_, q);
  RefusedWatch::Await(&service_, queues_, q);
}

}  // namespace layerserve
