// One unary RPC on the completion-queue API (completion_queues.h), from the
// moment it is requested from gRPC until gRPC is done with it: ModelInfer,
// the metadata and readiness RPCs, and the health check.
//
// A method is a UnaryMethod: how to request its next call from gRPC (the
// generated RequestX, bound to its service), how many calls each queue keeps
// requested, and the handler. The handler runs on the queue's thread when a
// call arrives and must lead to exactly one Reply, at once or later from any
// thread (ModelInfer replies from the batcher's). The call object lives until
// its reply and its "done" notification (which also says whether the client
// cancelled) are both back from the queue.
//
// A raw method (kRaw) takes its request as bytes and parses it itself, and
// serializes its response: gRPC's generated code answers a request it cannot
// parse with INTERNAL ("Unable to parse request"), which says the server is
// at fault and reaches no handler, so no metric counts it. A raw call's
// handler runs whether its request parsed or not, and reads which in parsed().
#pragma once

#include <atomic>
#include <functional>
#include <type_traits>
#include <utility>
#include <variant>

#include "absl/status/status.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/async_unary_call.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "server/grpc/call_auth.h"
#include "server/grpc/completion_queues.h"
#include "server/grpc/status_convert.h"

namespace layerserve {

template <typename Request, typename Response, bool kRaw = false>
class UnaryCall;

template <typename Request, typename Response, bool kRaw = false>
struct UnaryMethod {
  using Call = UnaryCall<Request, Response, kRaw>;
  // What crosses the wire: the messages, or their bytes for a raw method.
  using WireRequest = std::conditional_t<kRaw, grpc::ByteBuffer, Request>;
  using WireResponse = std::conditional_t<kRaw, grpc::ByteBuffer, Response>;
  std::function<void(grpc::ServerContext*, WireRequest*,
                     grpc::ServerAsyncResponseWriter<WireResponse>*, grpc::ServerCompletionQueue*,
                     void*)>
      request;
  std::function<void(Call&)> handle;
  int calls_per_queue = 1;

  // Requests calls_per_queue calls on queue q; Start() does it per queue.
  void RequestCalls(CompletionQueues& queues, int q) const {
    for (int i = 0; i < calls_per_queue; ++i) Call::Await(*this, queues, q);
  }
};

template <typename Request, typename Response, bool kRaw>
class UnaryCall {
 public:
  using Method = UnaryMethod<Request, Response, kRaw>;

  // Requests one call of `method` on queue q (both must outlive it).
  static void Await(const Method& method, CompletionQueues& queues, int q) {
    queues.Request(q, [&](grpc::ServerCompletionQueue* cq) {
      auto* call = new UnaryCall(method, queues, q);
      // Before the call starts, as gRPC requires: the "done" tag is how a
      // cancellation becomes visible (cancelled()).
      call->context_.AsyncNotifyWhenDone(&call->done_);
      method.request(&call->context_, call->wire_request(), &call->responder_, cq,
                     &call->accepted_);
    });
  }

  UnaryCall(const UnaryCall&) = delete;
  UnaryCall& operator=(const UnaryCall&) = delete;

  const grpc::ServerContext& context() const { return context_; }
  const Request& request() const { return request_; }
  // OK, or (a raw call whose bytes are not a valid Request) INVALID_ARGUMENT
  // saying so; request() is then empty or partial.
  const absl::Status& parsed() const { return parsed_; }
  Response* response() { return &response_; }
  // Whether the client has cancelled; safe from any thread.
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  // Sends the response (OK) or the error alone; exactly once, from any
  // thread. Nothing of the call may be touched after it.
  void Reply(const absl::Status& status) {
    if (!status.ok()) {
      responder_.FinishWithError(ToGrpcStatus(status), &finished_);
    } else if constexpr (kRaw) {
      grpc::ByteBuffer bytes;
      bool own_buffer = false;
      const grpc::Status serialized =
          grpc::SerializationTraits<Response>::Serialize(response_, &bytes, &own_buffer);
      if (serialized.ok()) {
        responder_.Finish(bytes, grpc::Status::OK, &finished_);
      } else {
        responder_.FinishWithError(serialized, &finished_);
      }
    } else {
      responder_.Finish(response_, grpc::Status::OK, &finished_);
    }
  }

 private:
  UnaryCall(const Method& method, CompletionQueues& queues, int q)
      : method_(method), queues_(queues), queue_(q), responder_(&context_) {}

  void Accepted(bool ok) {
    // Not ok: the server is shutting down and the request was never matched
    // with a call; no other tag of this call will come back.
    if (!ok) {
      delete this;
      return;
    }
    Await(method_, queues_, queue_);  // the successor waits for the next arrival
    if constexpr (kRaw) {
      if (!grpc::SerializationTraits<Request>::Deserialize(&wire_request_, &request_).ok()) {
        parsed_ = absl::InvalidArgumentError(
            "the request is not a valid message of this RPC's type (it does not parse as a "
            "protobuf)");
      }
    }
    method_.handle(*this);
  }
  typename Method::WireRequest* wire_request() {
    if constexpr (kRaw) {
      return &wire_request_;
    } else {
      return &request_;
    }
  }
  void Done(bool) {
    cancelled_.store(context_.IsCancelled(), std::memory_order_release);
    Release();
  }
  void Finished(bool) { Release(); }
  // The reply and the done notification are both back: gRPC holds no
  // reference to this call any more.
  void Release() {
    if (outstanding_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  const Method& method_;
  CompletionQueues& queues_;
  const int queue_;
  grpc::ServerContext context_;
  Request request_;
  absl::Status parsed_;  // parsed()
  Response response_;
  // A raw call's bytes, parsed into request_ when the call arrives (empty
  // otherwise).
  std::conditional_t<kRaw, grpc::ByteBuffer, std::monostate> wire_request_;
  grpc::ServerAsyncResponseWriter<typename Method::WireResponse> responder_;
  std::atomic<bool> cancelled_{false};
  std::atomic<int> outstanding_{2};  // of an accepted call: finished and done
  MemberOp<UnaryCall> accepted_{this, &UnaryCall::Accepted};
  MemberOp<UnaryCall> finished_{this, &UnaryCall::Finished};
  MemberOp<UnaryCall> done_{this, &UnaryCall::Done};
};

// The request function of a generated RequestX method of `service` (declared
// in one of its generated bases), in the form UnaryMethod keeps: the call's
// events come back on the queue it arrived on.
template <typename Service, typename Base, typename Request, typename Response>
auto RequestOf(Service* service, void (Base::*request_x)(grpc::ServerContext*, Request*,
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
    if (!call.parsed().ok()) return call.Reply(call.parsed());  // raw: bytes that do not parse
    call.Reply(answer(call.request(), call.response()));
  };
}

}  // namespace layerserve
