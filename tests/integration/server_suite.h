// One layerserve process and a client connected to it, shared by every test
// of a suite: the set-up the integration suites would otherwise each write.
//
//   class BadInputTest : public ServerSuite<BadInputTest> {
//    public:
//     static std::vector<std::string> ServerArgs() { return {"--max-batch-tokens=256"}; }
//   };
//
// The server starts once, in SetUpTestSuite, with the suite's ServerArgs()
// (none by default); a failed start fails every test of the suite with the
// reason instead of crashing it. A suite with more shared state defines its
// own SetUpTestSuite and TearDownTestSuite that call these first and last.
// `Base` is ::testing::Test or a ::testing::TestWithParam<...>.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "tests/integration/server_process.h"

namespace layerserve::integration {

template <typename Suite, typename Base = ::testing::Test>
class ServerSuite : public Base {
 public:
  // The flags the suite's server starts with, after the host and ports.
  static std::vector<std::string> ServerArgs() { return {}; }

 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<ServerProcess>> server =
        ServerProcess::Start(Suite::ServerArgs());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
    absl::StatusOr<std::unique_ptr<client::Client>> client =
        client::Client::Connect(server_->grpc_target());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = client->release();
  }
  static void TearDownTestSuite() {
    delete client_;
    delete server_;  // kills the child
    client_ = nullptr;
    server_ = nullptr;
  }
  // Fails each test of a suite whose server did not start (a suite with
  // set-up of its own overrides it to check that too).
  void SetUp() override { ASSERT_NE(client_, nullptr) << "the server did not start"; }

  static inline ServerProcess* server_ = nullptr;
  static inline client::Client* client_ = nullptr;
};

}  // namespace layerserve::integration
