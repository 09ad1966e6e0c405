// The draining server's admission rule (see drain.h).
#include "server/core/drain.h"

#include "absl/strings/str_cat.h"

namespace layerserve {

absl::Status AdmitWhileDraining(const std::optional<SessionParams>& session,
                                const SessionTable* sessions) {
  if (!session || sessions == nullptr) {
    return absl::UnavailableError("the server is shutting down");
  }
  if (session->start) {
    return absl::UnavailableError(
        absl::StrCat("the server is shutting down and opens no new session; start session ",
                     session->id.ToString(), " on another replica"));
  }
  return sessions->CheckOpen(session->id);
}

}  // namespace layerserve
