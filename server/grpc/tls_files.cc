// Reading and checking the gRPC port's TLS files (see tls_files.h).
#include "server/grpc/tls_files.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/regular_file.h"

namespace layerserve {
namespace {

// A certificate chain or CA bundle is kilobytes; a system bundle some 200
// KiB. Anything beyond this is a wrong path.
constexpr size_t kMaxPemFileBytes = size_t{4} << 20;

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* cert) const { X509_free(cert); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

absl::Status Bad(absl::string_view flag, const std::string& path, absl::string_view why) {
  // OpenSSL's error queue is per thread; leave it empty for gRPC, which
  // reads it after its own calls.
  ERR_clear_error();
  return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, " ", why));
}

absl::StatusOr<std::string> ReadPemFile(absl::string_view flag, const std::string& path) {
  absl::StatusOr<std::string> text = ReadRegularFile(path, kMaxPemFileBytes);
  if (text.status().code() == absl::StatusCode::kOutOfRange) {
    return Bad(flag, path, absl::StrCat("is larger than ", kMaxPemFileBytes >> 20, " MiB"));
  }
  if (!text.ok()) return Bad(flag, path, text.status().message());
  return text;
}

BioPtr MemoryBio(const std::string& text) {
  return BioPtr(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

// The certificates of a PEM text, in order; empty if it holds none.
std::vector<X509Ptr> ReadCertificates(const std::string& pem) {
  std::vector<X509Ptr> certificates;
  BioPtr bio = MemoryBio(pem);
  while (bio != nullptr) {
    X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
    if (cert == nullptr) break;
    certificates.push_back(std::move(cert));
  }
  ERR_clear_error();  // the end of the text reads as an error
  return certificates;
}

// OpenSSL's default would ask for a passphrase on the terminal.
int NoPassphrase(char*, int, int, void*) { return 0; }

}  // namespace

absl::StatusOr<TlsMaterial> LoadTlsMaterial(const std::string& cert_file,
                                            const std::string& key_file,
                                            const std::string& client_ca_file) {
  TlsMaterial material;
  absl::StatusOr<std::string> text = ReadPemFile("--tls-cert-file", cert_file);
  if (!text.ok()) return text.status();
  material.cert_chain_pem = *std::move(text);
  const std::vector<X509Ptr> chain = ReadCertificates(material.cert_chain_pem);
  if (chain.empty()) return Bad("--tls-cert-file", cert_file, "holds no PEM certificate");
  if (X509_cmp_current_time(X509_get0_notAfter(chain.front().get())) < 0) {
    return Bad("--tls-cert-file", cert_file, "holds a certificate that has expired");
  }

  text = ReadPemFile("--tls-key-file", key_file);
  if (!text.ok()) return text.status();
  material.private_key_pem = *std::move(text);
  BioPtr bio = MemoryBio(material.private_key_pem);
  PkeyPtr key(bio == nullptr ? nullptr
                             : PEM_read_bio_PrivateKey(bio.get(), nullptr, &NoPassphrase, nullptr));
  if (key == nullptr) {
    return Bad("--tls-key-file", key_file,
               "holds no PEM private key that can be read without a passphrase (an encrypted key "
               "is not supported)");
  }
  if (X509_check_private_key(chain.front().get(), key.get()) != 1) {
    return Bad("--tls-key-file", key_file,
               absl::StrCat("is not the key of the certificate in --tls-cert-file=", cert_file));
  }

  if (!client_ca_file.empty()) {
    text = ReadPemFile("--tls-client-ca-file", client_ca_file);
    if (!text.ok()) return text.status();
    material.client_ca_pem = *std::move(text);
    if (ReadCertificates(material.client_ca_pem).empty()) {
      return Bad("--tls-client-ca-file", client_ca_file, "holds no PEM certificate");
    }
  }
  ERR_clear_error();
  return material;
}

}  // namespace layerserve
