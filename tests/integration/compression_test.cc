// Compressed requests: gRPC 1.51 inflates a compressed message completely
// before the receive-size limit sees it, so a 0.5 MB gzip body could become
// 512 MB inside the server. The server accepts identity encoding only; a
// compressed request is refused from its grpc-encoding header, without
// inflating it. The test sends such a body by hand and watches the server's
// peak RSS (/proc/<pid>/status VmHWM).
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdio>
#include <memory>
#include <string>

#include "client/client.h"
#include "tests/integration/raw_grpc.h"
#include "tests/integration/server_process.h"

namespace layerserve::integration {
namespace {

constexpr int64_t kHidden = 512;
constexpr size_t kInflatedBytes = size_t{512} << 20;

// gzip of `bytes` zero bytes, streamed so the input never exists in memory.
std::string GzipOfZeros(size_t bytes) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, Z_BEST_COMPRESSION, Z_DEFLATED, 16 + 15, 9, Z_DEFAULT_STRATEGY), Z_OK);
  const std::string zeros(1 << 20, '\0');
  std::string out;
  char buffer[1 << 16];
  size_t fed = 0;
  int flush = Z_NO_FLUSH;
  do {
    if (z.avail_in == 0 && fed < bytes) {
      const size_t n = std::min(zeros.size(), bytes - fed);
      z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(zeros.data()));
      z.avail_in = static_cast<uInt>(n);
      fed += n;
      if (fed == bytes) flush = Z_FINISH;
    }
    z.next_out = reinterpret_cast<Bytef*>(buffer);
    z.avail_out = sizeof(buffer);
    const int rc = deflate(&z, flush);
    out.append(buffer, sizeof(buffer) - z.avail_out);
    if (rc == Z_STREAM_END) break;
  } while (true);
  deflateEnd(&z);
  return out;
}

TEST(CompressionTest, CompressedRequestsAreRefusedWithoutInflating) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  const pid_t pid = (*server)->pid();

  // A legal request first, so the baseline includes a served request.
  absl::StatusOr<std::unique_ptr<client::Client>> client =
      client::Client::Connect((*server)->grpc_target());
  ASSERT_TRUE(client.ok());
  const client::Tensor tensor{"FP32", {1, 2, kHidden}, std::string(2 * kHidden * 4, '\0')};
  ASSERT_TRUE((*client)->Infer("demo", tensor, absl::Now() + absl::Seconds(20)).ok());

  const std::string bomb = GzipOfZeros(kInflatedBytes);
  absl::StatusOr<int64_t> before_kb = ProcStatusKb(pid, "VmHWM");
  ASSERT_TRUE(before_kb.ok()) << before_kb.status();
  absl::StatusOr<RawGrpcReply> reply =
      RawGrpcCall((*server)->grpc_port(), "/inference.GRPCInferenceService/ModelInfer",
                  {.headers = {{"grpc-encoding", "gzip"}}, .body = GrpcFrame(bomb, true)});
  ASSERT_TRUE(reply.ok()) << reply.status();
  absl::StatusOr<int64_t> after_kb = ProcStatusKb(pid, "VmHWM");
  ASSERT_TRUE(after_kb.ok()) << after_kb.status();
  std::fprintf(stderr,
               "[test] gzip body of %zu bytes (%zu inflated): status %d, peak RSS %lld -> %lld "
               "MiB\n",
               bomb.size(), kInflatedBytes, reply->grpc_status,
               static_cast<long long>(*before_kb / 1024), static_cast<long long>(*after_kb / 1024));
  EXPECT_EQ(reply->grpc_status, static_cast<int>(absl::StatusCode::kUnimplemented));
  EXPECT_LT(*after_kb - *before_kb, 64 * 1024) << "the server inflated the body";

  // An uncompressed request still works, and so does the same client.
  ASSERT_TRUE((*client)->Infer("demo", tensor, absl::Now() + absl::Seconds(20)).ok());
}

}  // namespace
}  // namespace layerserve::integration
