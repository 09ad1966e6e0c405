// CompletionQueues (server/grpc/completion_queues.h) on an in-process gRPC
// server with no service: each queue's first calls are requested before its
// thread starts, a tag completes on its own queue's thread, and once the
// queues are shut down no request reaches them.
#include "server/grpc/completion_queues.h"

#include <grpcpp/alarm.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <chrono>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace layerserve {
namespace {

// A tag that notes the name of the thread completing it.
struct NamingOp final : AsyncOp {
  void Complete(bool ok_bit) override {
    char name[16] = {};
    pthread_getname_np(pthread_self(), name, sizeof(name));
    thread = name;
    ok = ok_bit;
    done.Notify();
  }
  std::string thread;
  bool ok = false;
  absl::Notification done;
};

TEST(CompletionQueuesTest, TagsCompleteOnTheirQueuesThread) {
  CompletionQueues queues(3);
  grpc::ServerBuilder builder;
  queues.AddTo(builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  std::vector<int> requested;
  queues.Start([&](int q) { requested.push_back(q); });
  EXPECT_EQ(requested, (std::vector<int>{0, 1, 2}));

  NamingOp op;
  grpc::Alarm alarm;
  queues.Request(2, [&](grpc::ServerCompletionQueue* cq) {
    alarm.Set(cq, std::chrono::system_clock::now(), static_cast<AsyncOp*>(&op));
  });
  ASSERT_TRUE(op.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(op.ok);
  EXPECT_EQ(op.thread, "grpc-cq-2");

  server->Shutdown();
  queues.Shutdown();
  bool ran = false;
  queues.Request(0, [&](grpc::ServerCompletionQueue*) { ran = true; });
  EXPECT_FALSE(ran) << "a request reached a queue after its shutdown";
  queues.Shutdown();  // idempotent
}

TEST(CompletionQueuesTest, QueuesThatNeverStartedShutDown) {
  CompletionQueues queues(2);
  grpc::ServerBuilder builder;
  queues.AddTo(builder);
  // No server is built from the builder (as when BuildAndStart fails): the
  // queues drain on the caller's thread.
  queues.Shutdown();
}

TEST(CompletionQueuesTest, DefaultThreadsAreAQuarterOfTheCoresFromTwoToEight) {
  const int threads = DefaultQueueThreads();
  EXPECT_GE(threads, 2);
  EXPECT_LE(threads, 8);
}

}  // namespace
}  // namespace layerserve
