// Bearer-token checks of gRPC calls (see call_auth.h).
#include "server/grpc/call_auth.h"

#include <memory>
#include <string_view>
#include <utility>
#include <vector>

namespace layerserve {

std::string CallerIdentity(const grpc::ServerContextBase& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return {};
  const std::vector<grpc::string_ref> pem = auth->FindPropertyValues("x509_pem_cert");
  if (pem.empty()) return {};
  return std::string("x509:") + std::string(pem.front().data(), pem.front().size());
}

CallAuthenticator::CallAuthenticator(std::string token, const OpenWithoutToken& open,
                                     ServerObserver* observer)
    : token_(std::move(token)), open_(open), observer_(observer) {}

bool CallAuthenticator::IsOpen(AuthRpc rpc) const {
  switch (rpc) {
    case AuthRpc::kHealth:
      return open_.health;
    case AuthRpc::kLive:
      return open_.live;
    case AuthRpc::kReady:
      return open_.ready;
    case AuthRpc::kMetadata:
      return open_.metadata;
    case AuthRpc::kStatistics:
      return open_.statistics;
    case AuthRpc::kInference:
      return false;
  }
  return false;
}

absl::Status CallAuthenticator::Check(const grpc::ServerContextBase& context, AuthRpc rpc) const {
  if (token_.empty() || IsOpen(rpc)) return absl::OkStatus();
  // gRPC lower-cases metadata keys; HTTP/2 sends them lower-case anyway.
  std::vector<std::string_view> values;
  const auto [begin, end] = context.client_metadata().equal_range("authorization");
  for (auto it = begin; it != end; ++it) values.emplace_back(it->second.data(), it->second.size());
  const BearerCheck check = CheckBearer(values, token_);
  if (check == BearerCheck::kOk) return absl::OkStatus();
  // Counted as a call of no model: the caller is not known to be a client of
  // the served model, and nothing it sent is looked at.
  if (observer_ != nullptr) {
    observer_->OnRequestFinished(
        {.model = {}, .code = "UNAUTHENTICATED", .duration_seconds = 0, .tokens = 0});
  }
  return absl::UnauthenticatedError(BearerRefusalMessage(check, "metadata"));
}

}  // namespace layerserve
