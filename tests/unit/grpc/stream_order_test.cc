// ModelStreamInfer's ordering guarantee (inference_service.cc): the requests
// of one stream reach the batcher in the order the client sent them, so a
// client can pipeline a session's steps on a stream. A real GrpcFrontend and
// Batcher run in process over a backend that records the order it computes
// requests in (the batcher takes its queue in order, so that is the order of
// enqueueing).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpc_service.grpc.pb.h"
#include "server/core/batcher.h"
#include "server/core/stats.h"
#include "server/grpc/grpc_frontend.h"

namespace layerserve {
namespace {

constexpr int64_t kHidden = 8;

// Copies input to output on its own thread and records request ids in the
// order it computes them.
class RecordingBackend final : public Backend {
 public:
  RecordingBackend() : worker_([this] { Work(); }) {}
  ~RecordingBackend() override {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    worker_.join();
  }
  std::string_view Name() const override { return "recording"; }
  int MaxInflightBatches() const override { return 2; }
  void Execute(std::shared_ptr<Batch> batch, std::function<void(absl::Status)> done) override {
    absl::MutexLock lock(&mu_);
    for (const auto& request : batch->requests) ids_.push_back(request->id);
    pending_.push_back({std::move(batch), std::move(done)});
  }
  std::vector<std::string> ids() const {
    absl::MutexLock lock(&mu_);
    return ids_;
  }

 private:
  struct Item {
    std::shared_ptr<Batch> batch;
    std::function<void(absl::Status)> done;
  };
  void Work() {
    for (;;) {
      Item item;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](RecordingBackend* b)
                 ABSL_EXCLUSIVE_LOCKS_REQUIRED(b->mu_) { return b->stop_ || !b->pending_.empty(); },
            this));
        if (pending_.empty()) return;
        item = std::move(pending_.front());
        pending_.pop_front();
      }
      for (auto& request : item.batch->requests) request->output.assign(request->input);
      item.done(absl::OkStatus());
    }
  }

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Item> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> ids_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
};

inference::ModelInferRequest Request(int i) {
  inference::ModelInferRequest request;
  request.set_model_name("demo");
  request.set_id(absl::StrCat(i));
  auto* input = request.add_inputs();
  input->set_name("hidden_states");
  input->set_datatype("FP32");
  for (int64_t dim : {int64_t{1}, int64_t{1}, kHidden}) input->add_shape(dim);
  request.add_raw_input_contents(std::string(kHidden * sizeof(float), static_cast<char>(i)));
  return request;
}

TEST(StreamOrderTest, RequestsOfOneStreamAreEnqueuedInTheOrderSent) {
  ServedModel model;
  model.name = "demo";
  model.backend = "recording";
  model.config.hidden_size = kHidden;
  model.max_batch_tokens = 64;
  model.max_queue_size = 1 << 20;
  RecordingBackend backend;
  ServerObserver observer;
  StatsRecorder stats;
  BatcherOptions batcher_options;
  batcher_options.policy.max_batch_tokens = model.max_batch_tokens;
  batcher_options.policy.max_queue_delay = std::chrono::microseconds(50);
  batcher_options.max_queue_size = model.max_queue_size;
  batcher_options.max_queue_bytes = int64_t{1} << 30;
  Batcher batcher(batcher_options, &backend, &observer, SteadyClock::Get());
  GrpcFrontendOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  absl::StatusOr<std::unique_ptr<GrpcFrontend>> frontend =
      GrpcFrontend::Start(options, model, &batcher, &backend, &observer, &stats);
  ASSERT_TRUE(frontend.ok()) << frontend.status();

  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*frontend)->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  constexpr int kStreams = 2;
  constexpr int kRequests = 1500;  // per stream, all written before any reply is read
  std::vector<std::thread> clients;
  for (int s = 0; s < kStreams; ++s) {
    clients.emplace_back([&, s] {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      auto stream = stub->ModelStreamInfer(&context);
      std::thread reader([&] {
        inference::ModelStreamInferResponse response;
        int answered = 0;
        while (stream->Read(&response)) {
          EXPECT_EQ(response.error_message(), "") << response.infer_response().id();
          ++answered;
        }
        EXPECT_EQ(answered, kRequests);
      });
      for (int i = 0; i < kRequests; ++i) {
        // Ids interleave across streams: stream s sends s, s + kStreams, ...
        if (!stream->Write(Request(i * kStreams + s))) {
          ADD_FAILURE() << "write " << i << " failed";
          break;
        }
      }
      stream->WritesDone();
      reader.join();
      const grpc::Status status = stream->Finish();
      EXPECT_TRUE(status.ok()) << status.error_message();
    });
  }
  for (std::thread& client : clients) client.join();
  batcher.Shutdown();
  (*frontend)->Shutdown(absl::Now());

  // Per stream, the ids the backend computed must be that stream's in order.
  const std::vector<std::string> ids = backend.ids();
  ASSERT_EQ(ids.size(), static_cast<size_t>(kStreams * kRequests));
  std::vector<int> next(kStreams, 0);
  for (const std::string& id : ids) {
    const int value = std::stoi(id);
    const int s = value % kStreams;
    ASSERT_EQ(value / kStreams, next[s]) << "stream " << s << " reordered at request " << next[s];
    ++next[s];
  }
}

}  // namespace
}  // namespace layerserve
