// The edge's half of a ModelInfer request (see infer_handler.h).
#include "server/grpc/infer_handler.h"

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/core/drain.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/model_info.h"
#include "server/grpc/request_convert.h"
#include "server/grpc/session_header.h"
#include "server/grpc/status_convert.h"

namespace layerserve {
namespace {

double SecondsSince(SteadyTime start) {
  return std::chrono::duration<double>(SteadyClock::Get()->Now() - start).count();
}

}  // namespace

InferHandler::InferHandler(const ServedModel& model, Batcher* batcher, ServerObserver* observer,
                           const ServingState* state, size_t max_reply_bytes)
    : model_(model),
      limits_(LimitsOf(model)),
      batcher_(batcher),
      observer_(observer),
      state_(state),
      max_reply_bytes_(max_reply_bytes) {}

void InferHandler::Submit(const grpc::ServerContextBase& context,
                          std::function<bool()> is_cancelled,
                          const inference::ModelInferRequest* request,
                          inference::ModelInferResponse* response, Reply reply) {
  const SteadyTime receipt = SteadyClock::Get()->Now();
  // A call for a model (or version) this server does not serve is reported
  // under no model: it is not the served model's traffic, and the name comes
  // from the client, so it must not become a label or a statistics entry.
  // It is never accepted, so it is not in flight either.
  if (absl::Status unknown = CheckModel(model_, request->model_name(), request->model_version());
      !unknown.ok()) {
    return RefuseUnserved(unknown, receipt, reply);
  }
  AddInflight(1);
  absl::Status status = state_->BackendReadiness();
  if (!status.ok()) return Complete(reply, status, receipt, 0);

  // raw_deadline(), not deadline(): gRPC's conversion to system_clock
  // overflows for deadlines past 2262 (see SteadyDeadline).
  const gpr_timespec raw_deadline = context.raw_deadline();
  const std::optional<SteadyTime> transport_deadline =
      SteadyDeadline(raw_deadline, gpr_now(raw_deadline.clock_type), receipt);
  absl::StatusOr<std::unique_ptr<InferRequest>> made =
      MakeInferRequest(*request, model_, limits_, transport_deadline, receipt);
  if (!made.ok()) return Complete(reply, made.status(), receipt, 0);

  std::unique_ptr<InferRequest> infer = *std::move(made);
  status = CheckSessionHeader(SessionHeaderValues(context), infer->session);
  if (!status.ok()) return Complete(reply, status, receipt, 0);
  // A session belongs to the caller that names it (call_auth.h).
  if (infer->session) infer->session->id = infer->session->id.OwnedBy(CallerIdentity(context));
  // Draining: only steps of the sessions still open get in.
  if (state_->draining()) {
    status = AdmitWhileDraining(infer->session, batcher_->sessions());
    if (!status.ok()) return Complete(reply, status, receipt, 0);
  }
  InferRequest* const raw = infer.get();  // owned by the core until on_done returns
  const int64_t tokens = raw->tokens();
  raw->is_cancelled = std::move(is_cancelled);
  raw->on_done = [this, raw, response, reply, receipt, tokens](absl::Status done) {
    if (done.ok()) done = FillInferResponse(model_, *raw, response);
    if (done.ok() && response->ByteSizeLong() > max_reply_bytes_) {
      done = absl::ResourceExhaustedError(
          absl::StrCat("the reply would be ", response->ByteSizeLong(),
                       " bytes, more than the largest reply this server sends (", max_reply_bytes_,
                       " bytes); send fewer tokens per request"));
    }
    if (!done.ok()) response->Clear();
    Complete(reply, done, receipt, tokens, raw);
  };
  // Queue full is RESOURCE_EXHAUSTED (the documented choice; Triton says
  // UNAVAILABLE); shutting down is UNAVAILABLE. Either way the request comes
  // back to us and on_done will not run.
  status = batcher_->Enqueue(infer);
  if (!status.ok()) Complete(reply, status, receipt, tokens);
}

void InferHandler::RefuseUnparsed(const absl::Status& why, const Reply& reply) {
  RefuseUnserved(why, SteadyClock::Get()->Now(), reply);
}

void InferHandler::RefuseUnserved(const absl::Status& status, SteadyTime receipt,
                                  const Reply& reply) {
  const std::string code = StatusCodeName(status);
  observer_->OnRequestFinished(
      {.model = {}, .code = code, .duration_seconds = SecondsSince(receipt), .tokens = 0});
  reply(status);
}

void InferHandler::Complete(const Reply& reply, const absl::Status& status, SteadyTime receipt,
                            int64_t tokens, const InferRequest* ran) {
  const std::string code = StatusCodeName(status);
  observer_->OnRequestFinished(
      {.model = model_.name,
       .code = code,
       .duration_seconds = SecondsSince(receipt),
       .tokens = tokens,
       .compute_seconds = ran != nullptr ? ran->compute_seconds : 0,
       .reply_wait_seconds = ran != nullptr ? ran->reply_wait_seconds : 0});
  AddInflight(-1);
  // Statistics are recorded before the reply, so a client that asks for them
  // right after its answer sees its own request counted.
  reply(status);
}

void InferHandler::AddInflight(int64_t delta) {
  absl::MutexLock lock(&inflight_mu_);
  inflight_ += delta;
  observer_->OnInflight(inflight_);
}

}  // namespace layerserve
