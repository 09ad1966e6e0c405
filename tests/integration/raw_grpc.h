// A deliberately crude gRPC-over-HTTP/2 client for tests that must send what
// a gRPC library will not: a grpc-timeout beyond what gRPC C++ encodes (it
// caps its own at 27000H), a grpc-encoding the body does not match, or a
// message prefix announcing more bytes than are sent.
//
// One call per fresh TCP connection to 127.0.0.1: request headers go out as
// HPACK literals without Huffman coding, and the reply's status is read by
// scanning the trailers for the literal "grpc-status", which is how gRPC's
// encoder writes it the first time on a connection (it indexes it only for
// later replies). Enough for a test, nothing more.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace layerserve::integration {

struct RawGrpcReply {
  // Payload of every DATA frame of the stream (gRPC length-prefixed messages).
  std::string data;
  // grpc-status from the trailers, -1 if none was found (for example when
  // the stream was reset or the connection closed first).
  int grpc_status = -1;
  std::string grpc_message;   // percent-encoded, as sent
  bool stream_reset = false;  // RST_STREAM or GOAWAY received
  // Body bytes the server let us send before it answered or the flow-control
  // window closed.
  size_t body_bytes_sent = 0;
};

struct RawGrpcCallOptions {
  // Extra request headers after the standard ones (content-type, te, ...).
  std::vector<std::pair<std::string, std::string>> headers;
  // The request body as written to DATA frames, already framed (GrpcFrame),
  // or a prefix of it.
  std::string body;
  // False: leave the stream open after the body (the server then waits for
  // the rest of an announced message and has to decide from what it has).
  bool end_stream = true;
  absl::Duration timeout = absl::Seconds(20);
};

// One unary call of `path` ("/inference.GRPCInferenceService/ModelInfer").
// Errors only for socket failures and timeouts; whatever the server answers
// is in the reply.
absl::StatusOr<RawGrpcReply> RawGrpcCall(int port, const std::string& path,
                                         const RawGrpcCallOptions& options);

// The gRPC message framing: flag byte (1 = compressed), 4-byte big-endian
// length (by default the payload's), payload.
std::string GrpcFrame(const std::string& payload, bool compressed = false,
                      int64_t announced_length = -1);

}  // namespace layerserve::integration
