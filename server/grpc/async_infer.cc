// Unary ModelInfer on the completion-queue API (see async_infer.h).
#include "server/grpc/async_infer.h"

#include <pthread.h>

#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/async_unary_call.h"
#include "server/grpc/status_convert.h"

namespace layerserve {

// One ModelInfer call, from the moment it is requested from gRPC until
// gRPC is done with it. Each event it waits for has its own tag, which the
// queue's thread hands back to OnEvent.
class AsyncInfer::Call {
 public:
  enum class Event { kAccepted, kFinished, kDone };
  struct Tag {
    Call* call;
    Event event;
  };

  Call(AsyncInfer* owner, int queue) : owner_(owner), queue_(queue), responder_(&context_) {}

  void Request(grpc::ServerCompletionQueue* cq) {
    // Before the call starts, as gRPC requires: the "done" tag is how a
    // cancellation becomes visible to the batcher (is_cancelled below).
    context_.AsyncNotifyWhenDone(&done_tag_);
    owner_->service_->RequestModelInfer(&context_, &request_, &responder_, cq, cq, &accepted_tag_);
  }

  void OnEvent(Event event, bool ok) {
    switch (event) {
      case Event::kAccepted:
        // Not ok: the server is shutting down and the request was never
        // matched with a call; no other tag of this call will come back.
        if (!ok) {
          delete this;
          return;
        }
        owner_->RequestCall(queue_);  // the successor waits for the next arrival
        Handle();
        return;
      case Event::kDone:
        cancelled_.store(context_.IsCancelled(), std::memory_order_release);
        break;
      case Event::kFinished:
        break;
    }
    // Both the reply and the done notification are back: gRPC holds no
    // reference to this call any more.
    if (outstanding_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

 private:
  void Handle() {
    if (absl::Status refused = owner_->auth_->Check(context_, AuthRpc::kInference); !refused.ok()) {
      responder_.FinishWithError(ToGrpcStatus(refused), &finished_tag_);
      return;
    }
    // The request lives in this object until kFinished, which is what lets
    // the core read the tensor in place.
    owner_->infer_->Submit(
        context_, [this] { return cancelled_.load(std::memory_order_acquire); }, &request_,
        &response_,
        [this](const absl::Status& status) {
          if (status.ok()) {
            responder_.Finish(response_, grpc::Status::OK, &finished_tag_);
          } else {
            responder_.FinishWithError(ToGrpcStatus(status), &finished_tag_);
          }
        });
  }

  AsyncInfer* const owner_;
  const int queue_;
  grpc::ServerContext context_;
  inference::ModelInferRequest request_;
  inference::ModelInferResponse response_;
  grpc::ServerAsyncResponseWriter<inference::ModelInferResponse> responder_;
  // Set when the done notification says the client cancelled; read by the
  // batcher's scheduler while the request is queued.
  std::atomic<bool> cancelled_{false};
  // Of an accepted call: kFinished and kDone, in either order.
  std::atomic<int> outstanding_{2};
  Tag accepted_tag_{this, Event::kAccepted};
  Tag finished_tag_{this, Event::kFinished};
  Tag done_tag_{this, Event::kDone};
};

AsyncInfer::AsyncInfer(InferenceServiceBase* service, InferHandler* infer,
                       const CallAuthenticator* auth, int threads)
    : service_(service), infer_(infer), auth_(auth), num_threads_(threads) {}

AsyncInfer::~AsyncInfer() { Shutdown(); }

void AsyncInfer::AddQueues(grpc::ServerBuilder& builder) {
  for (int q = 0; q < num_threads_; ++q) queues_.push_back(builder.AddCompletionQueue());
}

void AsyncInfer::Start() {
  for (int q = 0; q < num_threads_; ++q) {
    for (int i = 0; i < kCallsPerQueue; ++i) RequestCall(q);
    threads_.emplace_back([this, q] { Poll(q); });
  }
}

void AsyncInfer::RequestCall(int q) {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return;
  (new Call(this, q))->Request(queues_[q].get());
}

void AsyncInfer::Poll(int q) {
  const std::string name = absl::StrCat("grpc-infer-", q);  // as top -H shows it
  pthread_setname_np(pthread_self(), name.c_str());
  void* tag = nullptr;
  bool ok = false;
  while (queues_[q]->Next(&tag, &ok)) {
    auto* t = static_cast<Call::Tag*>(tag);
    t->call->OnEvent(t->event, ok);
  }
}

void AsyncInfer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return;
    shutting_down_ = true;
  }
  // The queues hand back what is left (requested calls, with ok false), then
  // Next returns false and each thread ends.
  for (auto& queue : queues_) queue->Shutdown();
  if (threads_.empty()) {
    // Never started (the server failed to start): drain here.
    for (int q = 0; q < static_cast<int>(queues_.size()); ++q) Poll(q);
  }
  for (auto& thread : threads_) thread.join();
  threads_.clear();
}

}  // namespace layerserve
