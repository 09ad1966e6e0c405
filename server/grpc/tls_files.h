// The TLS material of the gRPC port, read from the files the --tls-* flags
// name and checked with OpenSSL at start-up, before the model loads, so that a
// wrong path or a key that does not match its certificate stops the server in
// milliseconds with a line naming the flag (gRPC itself would only fail to
// start, after the load, with a line of its own).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace layerserve {

// PEM text, as gRPC's SslServerCredentials takes it.
struct TlsMaterial {
  std::string cert_chain_pem;   // the server's certificate, then any intermediates
  std::string private_key_pem;  // the certificate's key, unencrypted
  // The CA certificates client certificates must chain to: mutual TLS, every
  // connection presents one. Empty: no client certificate is asked for.
  std::string client_ca_pem;
};

// Reads and checks --tls-cert-file (one or more certificates; the first, the
// server's, not expired), --tls-key-file (an unencrypted private key that
// belongs to that certificate) and, unless `client_ca_file` is empty,
// --tls-client-ca-file (one or more certificates). INVALID_ARGUMENT naming
// the flag and the file for the first that fails; no message holds a byte
// of the key.
absl::StatusOr<TlsMaterial> LoadTlsMaterial(const std::string& cert_file,
                                            const std::string& key_file,
                                            const std::string& client_ca_file);

}  // namespace layerserve
