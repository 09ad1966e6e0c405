// What a draining server still computes. On SIGTERM the server turns
// unready and stops taking new work, but its open sessions hold KV caches
// that no other replica has: their steps are still taken until each session
// ends or --drain-sessions-timeout-s runs out (server/main.cc runs that
// phase; SessionTable::DropForDrain ends it). This is the one rule for which
// request gets in meanwhile; the gRPC edge asks it for every request it
// receives while draining (docs/protocol.md, Shutdown).
#pragma once

#include <optional>

#include "absl/status/status.h"
#include "server/core/request.h"
#include "server/core/sessions.h"

namespace layerserve {

// For a request received while the server drains (`session`: its session
// parameters, nullopt for a stateless request; `sessions`: the server's
// table, null when it keeps none):
//   OK           a step (no sequence_start) of a session the table holds open;
//   NOT_FOUND    a step of a session it does not hold: the table's own
//                message (not found, expired, or dropped by a drain);
//   UNAVAILABLE  a stateless request ("the server is shutting down") or a
//                sequence_start (no new sessions): work another replica can
//                take, so a client retries it elsewhere.
absl::Status AdmitWhileDraining(const std::optional<SessionParams>& session,
                                const SessionTable* sessions);

}  // namespace layerserve
