// Bearer-token authentication of gRPC calls (--auth-token-file): every RPC
// handler of the inference and health services asks Check() first, and a call
// that may not proceed is finished at once with UNAUTHENTICATED.
//
// Why a check in the handlers, and not an AuthMetadataProcessor on the server
// credentials or an interceptor: gRPC 1.51 allows a metadata processor only
// on TLS credentials (InsecureServerCredentials asserts), and a token must
// also work on a plaintext port behind a TLS-terminating proxy or mesh; its
// server interceptors cannot fail a call. A handler also knows exactly which
// RPC it serves, so --auth-open needs no parsing of the :path. The price: the
// completion-queue API hands over a unary call only once its request is in, so
// an unauthenticated ModelInfer is refused after gRPC has received and parsed
// its message (at most the receive limit); a ModelStreamInfer is refused
// before its first message is read. docs/security.md says so.
//
// Threading: Check() is const and only reads what the constructor set; any
// gRPC thread may call it.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/server_context.h"
#include "server/auth/auth_token.h"
#include "server/core/observer.h"

namespace layerserve {

// The RPCs, grouped as --auth-open names them.
enum class AuthRpc {
  kHealth,      // grpc.health.v1.Health/Check
  kLive,        // ServerLive
  kReady,       // ServerReady, ModelReady
  kMetadata,    // ServerMetadata, ModelMetadata, ModelConfig, RepositoryIndex
  kStatistics,  // ModelStatistics
  kInference,   // ModelInfer, ModelStreamInfer: never open
};

// Who the caller is, for what it owns (its sessions: SessionId::OwnedBy): the
// client certificate the TLS handshake verified (its PEM, as gRPC's auth
// context holds it), or empty where the call carries none. A bearer token
// names no one: every holder of the one token is one caller.
std::string CallerIdentity(const grpc::ServerContextBase& context);

class CallAuthenticator {
 public:
  // `token` empty: no authentication, every call proceeds. Otherwise the
  // RPCs `open` names proceed without a token and the others need
  // "authorization: Bearer <token>". `observer` (may be null) hears of each
  // refused call as a request of no model with code UNAUTHENTICATED; it must
  // outlive the authenticator.
  CallAuthenticator(std::string token, const OpenWithoutToken& open, ServerObserver* observer);

  // OK when the call may proceed; UNAUTHENTICATED (reported to the observer)
  // when it may not, with a message that quotes nothing the client sent.
  absl::Status Check(const grpc::ServerContextBase& context, AuthRpc rpc) const;

  bool enabled() const { return !token_.empty(); }

 private:
  bool IsOpen(AuthRpc rpc) const;

  const std::string token_;
  const OpenWithoutToken open_;
  ServerObserver* const observer_;
};

}  // namespace layerserve
