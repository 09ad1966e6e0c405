// The edge's status conversion keeps code and message, and caps the message
// so no status outgrows a client's metadata limit.
#include "server/grpc/status_convert.h"

#include <gtest/gtest.h>

#include <string>

namespace layerserve {
namespace {

TEST(StatusConvertTest, KeepsCodeAndShortMessage) {
  const grpc::Status status = ToGrpcStatus(absl::NotFoundError("unknown model 'x'"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "unknown model 'x'");
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

TEST(StatusConvertTest, CapsLongMessages) {
  const std::string huge(1 << 20, 'm');
  const grpc::Status status = ToGrpcStatus(absl::InvalidArgumentError(huge));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(status.error_message().size(), kMaxStatusMessageBytes + 32);
  EXPECT_NE(status.error_message().find("more bytes)"), std::string::npos);

  const std::string stream = StreamErrorMessage(absl::InvalidArgumentError(huge));
  EXPECT_EQ(stream.rfind("INVALID_ARGUMENT: ", 0), 0u);
  EXPECT_LT(stream.size(), kMaxStatusMessageBytes + 64);
}

}  // namespace
}  // namespace layerserve
