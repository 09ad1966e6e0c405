// Bearer-token authentication, the part the gRPC edge (server/grpc/call_auth.h)
// and the metrics endpoint (server/metrics) share: reading the token file,
// checking an `authorization` value against the token in constant time, and
// --auth-open, the list of what stays open without a token.
//
// Nothing here puts a token, or what a client sent, into a message or a log:
// a refusal says only what kind of refusal it is.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace layerserve {

// The token a --auth-token-file names: the file's bytes without trailing
// whitespace (so "token\n", as `echo` writes it, is "token"). Errors, each
// naming the flag and the file but never its contents: the file cannot be
// read, is empty (after the strip), or holds a byte outside printable ASCII
// without space (0x21-0x7e) — a header value carries no other byte, and a
// space would make "Bearer a b" ambiguous. `flag` names the flag in messages.
absl::StatusOr<std::string> ReadAuthTokenFile(const std::string& path,
                                              std::string_view flag = "--auth-token-file");

// True iff `presented` equals `secret` (a non-empty secret). The time it takes
// depends on presented.size() alone, which the caller already knows: not on
// the secret's length or bytes, nor on where the two first differ, so timing
// refusals reveals nothing of the secret.
bool ConstantTimeEquals(std::string_view presented, std::string_view secret);

// What checking a request's `authorization` values found.
enum class BearerCheck {
  kOk,         // exactly one value, "Bearer <secret>" (the scheme in any case)
  kMissing,    // no value
  kMalformed,  // more than one value, or one that is not "Bearer <token>"
  kWrong,      // "Bearer <token>" with another token
};

// Checks every `authorization` value a request carried against `secret`
// (non-empty). Constant-time in the secret (ConstantTimeEquals).
BearerCheck CheckBearer(const std::vector<std::string_view>& values, std::string_view secret);

// The refusal's message for a check that is not kOk; it quotes nothing the
// client sent. `where` is "metadata" (gRPC) or "header" (HTTP).
std::string BearerRefusalMessage(BearerCheck check, std::string_view where);

// What --auth-open leaves open to calls without a token, when the server
// requires one (--auth-token-file). Inference (ModelInfer, ModelStreamInfer)
// is never open.
struct OpenWithoutToken {
  bool health = true;       // grpc.health.v1.Health/Check; the metrics port's /healthz
  bool live = true;         // ServerLive
  bool ready = true;        // ServerReady, ModelReady
  bool metadata = false;    // ServerMetadata, ModelMetadata, ModelConfig
  bool statistics = false;  // ModelStatistics
  bool metrics = true;      // the metrics port's /metrics
};

// The default of --auth-open: the probes (Kubernetes' gRPC probe, a
// load balancer's health check, Docker's HEALTHCHECK through `layerctl
// health`) and Prometheus' scrape, which carry no credentials by default.
inline constexpr char kDefaultAuthOpen[] = "health,live,ready,metrics";

// --auth-open's value: a comma-separated list of health, live, ready,
// metadata, statistics, metrics; or "none". INVALID_ARGUMENT naming the
// first word that is none of them.
absl::StatusOr<OpenWithoutToken> ParseAuthOpen(std::string_view list);

// The list ParseAuthOpen reads back into `open` ("none" for nothing).
std::string FormatAuthOpen(const OpenWithoutToken& open);

}  // namespace layerserve
