// The x-session-id request header: the session a call's requests belong to,
// in gRPC metadata (an HTTP/2 header), where an L7 proxy in front of several
// replicas can hash on it (nginx's $http_x_session_id, HAProxy's
// hdr(x-session-id)) and so send every step of a session to the replica that
// holds its KV cache. The sequence_id inside the protobuf body is invisible
// to a proxy; the header is how the body's session reaches the routing.
//
// A header that names another session than the body would make the proxy
// route by one session while the server steps another, so the edge checks
// them against each other (deploy/README.md, docs/sessions.md). On
// ModelStreamInfer the header is the stream's (sent when it opens): every
// request of such a stream names that one session.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/server_context.h"
#include "server/core/request.h"

namespace layerserve {

// The header's name, lower-case as HTTP/2 carries it.
inline constexpr char kSessionHeader[] = "x-session-id";

// Every value of the header the call carries (none, usually one).
std::vector<std::string_view> SessionHeaderValues(const grpc::ServerContextBase& context);

// Whether `header` (the values of x-session-id a call carries) agrees with
// the request's session (`session`, nullopt for a stateless request):
//   no header                      OK, whatever the request (clients that do
//                                  not route by session send none);
//   one value naming the session   OK: for an integer sequence_id its decimal
//                                  form (as int64, or as the uint64 with the
//                                  same bits: Triton's correlation ids are
//                                  uint64), for a string id the string itself;
//   anything else                  INVALID_ARGUMENT naming both values: a
//                                  value that names another session, a header
//                                  on a request without sequence_id, or the
//                                  header given more than once.
// The header's value is quoted as SessionId::ToString quotes a string id
// (escaped, and cut after 64 bytes), never whole.
absl::Status CheckSessionHeader(const std::vector<std::string_view>& header,
                                const std::optional<SessionParams>& session);

}  // namespace layerserve
