// grpc_echo: the floor under layerserve's request path on this machine. A
// server of ModelInfer alone that answers each request with its own input as
// the output, at once, on the thread that received it: the same gRPC
// library, completion queues and call objects as layerserve's edge
// (server/grpc/completion_queues.h, unary_call.h), and nothing behind them
// (no batcher, no backend, no reply threads, no metrics). `layerctl bench`
// drives it as it drives layerserve (pass --hidden, since it has no
// metadata RPC), so the difference between the two is what layerserve adds,
// and what is left on the echo is gRPC's and the client's own cost
// (docs/log/serving.md, "The floor under the request path").
//
// --delay-us=D answers each request D microseconds after it arrived, from
// --reply-threads threads (4, as layerserve's default) that take requests in
// turn and spin until each is due, as layerserve answers after a batch
// computed: a server whose every request takes D with no limit on how many
// at once, a bound for any server whose batches take D (gRPC's threads also
// wake slower after a wait than when busy).
//
//   grpc_echo [--port=P (0: pick one)] [--threads=N (completion queues)] [--delay-us=D]
//             [--reply-threads=R]
// Prints "port P" once it serves; runs until SIGINT or SIGTERM.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "base/mutex.h"
#include "base/thread_name.h"
#include "grpc_service.grpc.pb.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/grpc/completion_queues.h"
#include "server/grpc/unary_call.h"

namespace layerserve {
namespace {

using Service = inference::GRPCInferenceService::AsyncService;
using InferMethod = UnaryMethod<inference::ModelInferRequest, inference::ModelInferResponse>;

// The request's first input, returned as "hidden_states" with its shape and
// datatype, as layerserve's reply carries it.
absl::Status Echo(const inference::ModelInferRequest& request, inference::ModelInferResponse* response) {
  if (request.inputs_size() < 1 || request.raw_input_contents_size() < 1) {
    return absl::InvalidArgumentError("grpc_echo: the request has no raw input");
  }
  const auto& input = request.inputs(0);
  auto* output = response->add_outputs();
  output->set_name("hidden_states");
  output->set_datatype(input.datatype());
  *output->mutable_shape() = input.shape();
  response->set_model_name(request.model_name());
  response->add_raw_output_contents(request.raw_input_contents(0));
  return absl::OkStatus();
}

// Answers calls `delay` after they arrived, in arrival order, from one
// thread; a call costs its thread ~30 us of gRPC's send path, so one thread
// answers ~33 000 calls/s at most.
class DelayedReplies {
 public:
  DelayedReplies(std::chrono::microseconds delay, int index)
      : delay_(delay), thread_([this, index] {
          NameThisThread("reply-" + std::to_string(index));
          Run();
        }) {}
  ~DelayedReplies() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
      cv_.Signal();
    }
    thread_.join();
  }

  void Add(InferMethod::Call* call) {
    MutexLock lock(&mu_);
    pending_.push_back({call, std::chrono::steady_clock::now() + delay_});
    cv_.Signal();
  }

 private:
  struct Pending {
    InferMethod::Call* call;
    std::chrono::steady_clock::time_point due;
  };

  void Run() {
    for (;;) {
      Pending next;
      {
        MutexLock lock(&mu_);
        while (pending_.empty() && !stop_) cv_.Wait(&mu_);
        if (pending_.empty()) return;
        next = pending_.front();
        pending_.pop_front();
      }
      // Spun, not slept, as layerserve's stream threads spin on their
      // batch's event: a sleep would add the timer's own slack.
      while (std::chrono::steady_clock::now() < next.due) {
      }
      next.call->Reply(Echo(next.call->request(), next.call->response()));
    }
  }

  const std::chrono::microseconds delay_;
  Mutex mu_;
  CondVar cv_;
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the rest exists
};

// True when `arg` is `name` followed by a value; the value must be an integer
// (else it becomes -1, which every flag refuses).
bool ParseFlag(std::string_view arg, std::string_view name, int* value) {
  if (arg.substr(0, name.size()) != name) return false;
  const std::string text(arg.substr(name.size()));
  if (!absl::SimpleAtoi(text, value)) *value = -1;
  return true;
}

int Main(int argc, char** argv) {
  int port = 0;
  int threads = DefaultQueueThreads();
  int delay_us = 0;
  int reply_threads = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (!ParseFlag(arg, "--port=", &port) && !ParseFlag(arg, "--threads=", &threads) &&
        !ParseFlag(arg, "--delay-us=", &delay_us) && !ParseFlag(arg, "--reply-threads=", &reply_threads)) {
      std::fprintf(stderr, "usage: grpc_echo [--port=P] [--threads=N] [--delay-us=D] [--reply-threads=R]\n");
      return 2;
    }
  }
  if (threads < 1 || port < 0 || port > 65535 || delay_us < 0 || reply_threads < 1) {
    std::fprintf(stderr,
                 "grpc_echo: --threads and --reply-threads must be >= 1, --port in [0, 65535], "
                 "--delay-us >= 0\n");
    return 2;
  }
  // Blocked here, taken by sigwait below: the queue threads inherit the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  Service service;
  CompletionQueues queues(threads);
  // With a delay, the calls go to the replying threads in turn.
  std::vector<std::unique_ptr<DelayedReplies>> delayed;
  for (int i = 0; delay_us > 0 && i < reply_threads; ++i) {
    delayed.push_back(std::make_unique<DelayedReplies>(std::chrono::microseconds(delay_us), i));
  }
  std::atomic<uint64_t> next_replier{0};
  const InferMethod infer{RequestOf(&service, &Service::RequestModelInfer),
                          [&delayed, &next_replier](InferMethod::Call& call) {
                            if (delayed.empty()) {
                              return call.Reply(Echo(call.request(), call.response()));
                            }
                            delayed[next_replier.fetch_add(1) % delayed.size()]->Add(&call);
                          },
                          /*calls_per_queue=*/16};
  grpc::ServerBuilder builder;
  int bound_port = 0;
  builder.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(), &bound_port);
  builder.SetMaxReceiveMessageSize(1 << 30);
  builder.SetMaxSendMessageSize(1 << 30);
  builder.RegisterService(&service);
  queues.AddTo(builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound_port == 0) {
    std::fprintf(stderr, "grpc_echo: could not listen on port %d\n", port);
    return 1;
  }
  queues.Start([&](int q) { infer.RequestCalls(queues, q); });
  std::printf("port %d\n", bound_port);
  std::fflush(stdout);

  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  server->Shutdown();
  queues.Shutdown();
  return 0;
}

}  // namespace
}  // namespace layerserve

int main(int argc, char** argv) { return layerserve::Main(argc, argv); }
