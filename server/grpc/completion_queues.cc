// The server's completion queues and their threads (see completion_queues.h).
#include "server/grpc/completion_queues.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/thread_name.h"

namespace layerserve {

int DefaultQueueThreads() {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores / 4, 2, 8);
}

CompletionQueues::CompletionQueues(int threads) : queues_(static_cast<size_t>(threads)) {}

CompletionQueues::~CompletionQueues() { Shutdown(); }

void CompletionQueues::AddTo(grpc::ServerBuilder& builder) {
  for (auto& queue : queues_) queue = builder.AddCompletionQueue();
}

void CompletionQueues::Start(const std::function<void(int)>& request_calls) {
  for (int q = 0; q < size(); ++q) {
    request_calls(q);
    threads_.emplace_back([this, q] {
      NameThisThread(absl::StrCat("grpc-cq-", q));
      Poll(q);
    });
  }
}

void CompletionQueues::Request(int q,
                               absl::FunctionRef<void(grpc::ServerCompletionQueue*)> request) {
  absl::MutexLock lock(&mu_);
  if (!shutting_down_) request(queues_[static_cast<size_t>(q)].get());
}

void CompletionQueues::Poll(int q) {
  void* tag = nullptr;
  bool ok = false;
  while (queues_[static_cast<size_t>(q)]->Next(&tag, &ok)) static_cast<AsyncOp*>(tag)->Complete(ok);
}

void CompletionQueues::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return;
    shutting_down_ = true;
  }
  // The queues hand back what is left (requested calls, with ok false), then
  // Next returns false and each thread ends.
  for (auto& queue : queues_) {
    if (queue != nullptr) queue->Shutdown();
  }
  if (threads_.empty()) {
    // Never started (the server failed to start): drain here.
    for (int q = 0; q < size(); ++q) {
      if (queues_[static_cast<size_t>(q)] != nullptr) Poll(q);
    }
  }
  for (auto& thread : threads_) thread.join();
  threads_.clear();
}

}  // namespace layerserve
