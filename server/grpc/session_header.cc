// The x-session-id header against the request's sequence_id (see
// session_header.h).
#include "server/grpc/session_header.h"

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace layerserve {
namespace {

// The header's value for messages: quoted and escaped like a string id, cut
// as SessionId::ToString cuts one.
std::string Quoted(std::string_view value) { return SessionId(std::string(value)).ToString(); }

bool Names(std::string_view value, const SessionId& id) {
  if (id.is_string()) return value == id.string_value();
  return value == absl::StrCat(id.int_value()) ||
         value == absl::StrCat(static_cast<uint64_t>(id.int_value()));
}

}  // namespace

std::vector<std::string_view> SessionHeaderValues(const grpc::ServerContextBase& context) {
  std::vector<std::string_view> values;
  const auto [begin, end] = context.client_metadata().equal_range(kSessionHeader);
  for (auto it = begin; it != end; ++it) values.emplace_back(it->second.data(), it->second.size());
  return values;
}

absl::Status CheckSessionHeader(const std::vector<std::string_view>& header,
                                const std::optional<SessionParams>& session) {
  if (header.empty()) return absl::OkStatus();
  if (header.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header ", kSessionHeader, " is given ", header.size(),
        " times; a call names at most one session (a proxy routes it by that header)"));
  }
  const std::string_view value = header.front();
  if (!session) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header ", kSessionHeader, " names session ", Quoted(value),
        " but the request has no sequence_id; a session's requests carry both (the header routes "
        "the call, sequence_id names the session), a stateless request neither"));
  }
  if (Names(value, session->id)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "header ", kSessionHeader, " is ", Quoted(value), " but the request's sequence_id is ",
      session->id.ToString(),
      "; they must name the same session, since a proxy routes the call by the header (on a "
      "stream, the header is the stream's: every request of it names that session)"));
}

}  // namespace layerserve
