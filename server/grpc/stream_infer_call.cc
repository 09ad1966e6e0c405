// ModelStreamInfer on the completion-queue API (see stream_infer_call.h).
#include "server/grpc/stream_infer_call.h"

#include <utility>

#include "absl/status/status.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "server/grpc/status_convert.h"

namespace layerserve {

void StreamInferCall::Await(const Deps& deps, int q) {
  deps.queues->Request(q, [&](grpc::ServerCompletionQueue* cq) {
    auto* call = new StreamInferCall(deps, q);
    // Before the call starts, as gRPC requires.
    call->context_.AsyncNotifyWhenDone(&call->done_op_);
    deps.service->RequestModelStreamInfer(&call->context_, &call->stream_, cq, cq,
                                          &call->accepted_op_);
  });
}

StreamInferCall::StreamInferCall(const Deps& deps, int q)
    : deps_(deps), queue_(q), stream_(&context_) {}

void StreamInferCall::Accepted(bool ok) {
  // Not ok: the server is shutting down and the request was never matched
  // with a call; no other tag of this call will come back.
  if (!ok) {
    delete this;
    return;
  }
  Await(deps_, queue_);  // the successor waits for the next arrival
  // Refused before the first read: no request of an unauthenticated stream
  // is received.
  if (absl::Status refused = deps_.auth->Check(context_, AuthRpc::kInference); !refused.ok()) {
    {
      absl::MutexLock lock(&mu_);
      finished_ = true;
    }
    stream_.Finish(ToGrpcStatus(refused), &finish_op_);
    return;
  }
  deps_.state->StreamOpened();
  opened_ = true;
  StartRead();
}

void StreamInferCall::StartRead() {
  reading_.Clear();
  stream_.Read(&reading_, &read_op_);
}

void StreamInferCall::StartWrite(const inference::ModelStreamInferResponse& response) {
  written_.Clear();  // the last write's bytes: that write is done
  bool own_buffer = false;
  if (!grpc::SerializationTraits<inference::ModelStreamInferResponse>::Serialize(
           response, &written_, &own_buffer)
           .ok()) {
    WriteDone(false);  // unwritable (past protobuf's 2 GiB): as a client gone
    return;
  }
  stream_.Write(written_, &write_op_);
}

void StreamInferCall::ReadDone(bool ok) {
  if (!ok) {  // half-close, cancellation or a broken connection
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      reads_done_ = true;
      finish = ShouldFinishLocked();
    }
    if (finish) stream_.Finish(grpc::Status::OK, &finish_op_);
    return;
  }
  const size_t bytes = reading_.Length();
  auto request = std::make_unique<inference::ModelInferRequest>();
  const bool parsed =
      grpc::SerializationTraits<inference::ModelInferRequest>::Deserialize(&reading_, request.get())
          .ok();
  if (!parsed) request->Clear();  // (a partial parse carries no id to echo)
  Pending* pending = nullptr;
  {
    absl::MutexLock lock(&mu_);
    // Its place in the reply order; also keeps the call from finishing
    // until it is answered and written.
    in_order_.push_back(std::make_unique<Pending>(Pending{std::move(request), {}, false, bytes}));
    backlog_bytes_ += bytes;
    pending = in_order_.back().get();
  }
  // Submit (or refuse) before the next read starts (the ordering
  // guarantee). Neither blocks; the call cannot finish in between, since
  // reads are not done.
  const auto answer = [this, pending](const absl::Status& status) { Answer(pending, status); };
  if (!parsed) {
    deps_.infer->RefuseUnparsed(
        absl::InvalidArgumentError("the stream's message is not a valid ModelInferRequest (it does "
                                   "not parse as a protobuf)"),
        answer);
  } else {
    deps_.infer->Submit(
        context_, [this] { return cancelled_.load(std::memory_order_acquire); },
        pending->request.get(), pending->response.mutable_infer_response(), answer);
  }
  // The next read, unless the backlog is at its bound: then the write path
  // resumes reading once it has drained. Decided after the Submit, so that
  // no read can start before it.
  {
    absl::MutexLock lock(&mu_);
    if (BacklogFullLocked()) {
      read_paused_ = true;
      return;
    }
  }
  StartRead();
}

bool StreamInferCall::BacklogFullLocked() const {
  return in_order_.size() + (writing_ != nullptr ? 1 : 0) >= kMaxUnwritten ||
         backlog_bytes_ >= kMaxUnwrittenBytes;
}

bool StreamInferCall::ShouldResumeReadingLocked() {
  if (!read_paused_) return false;
  const size_t held = in_order_.size() + (writing_ != nullptr ? 1 : 0);
  // A broken stream reads on so that the read fails and the call finishes.
  if (!broken_ && (held > kMaxUnwritten / 2 || backlog_bytes_ > kMaxUnwrittenBytes / 2))
    return false;
  read_paused_ = false;
  return true;
}

void StreamInferCall::Answer(Pending* pending, const absl::Status& status) {
  if (!status.ok()) {
    auto* infer_response = pending->response.mutable_infer_response();
    infer_response->Clear();
    // The id lets the client tell which of its requests failed.
    infer_response->set_id(pending->request->id());
    infer_response->set_model_name(pending->request->model_name());
    pending->response.set_error_message(StreamErrorMessage(status));
  }
  pending->request.reset();  // the core is done with the tensor
  const inference::ModelStreamInferResponse* write = nullptr;
  bool finish = false;
  bool resume = false;
  {
    absl::MutexLock lock(&mu_);
    pending->answered = true;  // from here on the writer owns it
    write = NextWriteLocked();
    finish = ShouldFinishLocked();
    resume = ShouldResumeReadingLocked();
  }
  if (write != nullptr) StartWrite(*write);
  if (resume) StartRead();
  if (finish) stream_.Finish(grpc::Status::OK, &finish_op_);
}

void StreamInferCall::WriteDone(bool ok) {
  const inference::ModelStreamInferResponse* next = nullptr;
  bool finish = false;
  bool resume = false;
  {
    absl::MutexLock lock(&mu_);
    backlog_bytes_ -= writing_->bytes;
    writing_.reset();
    if (!ok) broken_ = true;  // the client is gone: later answers are dropped
    next = NextWriteLocked();
    finish = ShouldFinishLocked();
    resume = ShouldResumeReadingLocked();
  }
  if (next != nullptr) StartWrite(*next);
  if (resume) StartRead();
  if (finish) stream_.Finish(grpc::Status::OK, &finish_op_);
}

const inference::ModelStreamInferResponse* StreamInferCall::NextWriteLocked() {
  if (broken_) {
    // Nothing more is written; requests still in the core keep their
    // entries (the core holds pointers into them) until they are answered.
    while (!in_order_.empty() && in_order_.front()->answered) {
      backlog_bytes_ -= in_order_.front()->bytes;
      in_order_.pop_front();
    }
    return nullptr;
  }
  if (writing_ != nullptr || in_order_.empty() || !in_order_.front()->answered) return nullptr;
  writing_ = std::move(in_order_.front());
  in_order_.pop_front();
  return &writing_->response;
}

bool StreamInferCall::ShouldFinishLocked() {
  if (finished_ || !reads_done_ || writing_ != nullptr || !in_order_.empty()) return false;
  finished_ = true;
  return true;
}

void StreamInferCall::Finished(bool) { Release(); }

void StreamInferCall::Done(bool) {
  cancelled_.store(context_.IsCancelled(), std::memory_order_release);
  if (opened_) deps_.state->StreamClosed();
  Release();
}

void StreamInferCall::Release() {
  // The finish and the done notification are both back: gRPC holds no
  // reference to this call any more.
  if (outstanding_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
}

}  // namespace layerserve
