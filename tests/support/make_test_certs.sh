#!/usr/bin/env bash
# Writes a throwaway PKI for the TLS tests into DIR, with the openssl CLI:
#   ca.crt                 the CA that signed the server and client certificates
#   server.crt server.key  CN=localhost, SAN localhost, 127.0.0.1, ::1 (serverAuth)
#   client.crt client.key  CN=layerserve-test-client (clientAuth), signed by ca
#   client2.crt client2.key  CN=layerserve-test-client-2, another caller ca signed
#   other-ca.crt           another CA, which signed nothing the server trusts
#   other-client.crt other-client.key  a client certificate other-ca signed
#   expired.crt expired.key  a server certificate, signed by ca, that expired a
#                          day before it began (openssl x509 -days -1)
# Keys are ECDSA P-256 (quick to make) and unencrypted; certificates are
# valid for two days. Made at test time rather than committed: no private key
# lives in the repository and none can expire under a test. Used by
# tests/integration/security_test.cc and tests/python/test_security.py.
# Usage: make_test_certs.sh DIR
set -euo pipefail
dir=${1:?usage: make_test_certs.sh DIR}
mkdir -p "$dir"
cd "$dir"

# quiet CMD...: runs CMD with its chatter kept back, shown only if it fails.
quiet() {
  local out
  if ! out=$("$@" 2>&1); then
    printf 'make_test_certs.sh: %s failed:\n%s\n' "$*" "$out" >&2
    return 1
  fi
}

key() { quiet openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1"; }

# ca NAME CN: a self-signed CA certificate and its key.
ca() {
  key "$1.key"
  quiet openssl req -x509 -new -key "$1.key" -out "$1.crt" -days 2 -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
}

# leaf NAME CA CN EXTENSIONS [openssl x509 flags...]: a key and a certificate CA signed.
leaf() {
  local name=$1 ca=$2 cn=$3 extensions=$4
  shift 4
  key "$name.key"
  quiet openssl req -new -key "$name.key" -subj "/CN=$cn" -out "$name.csr"
  printf '%b' "$extensions" > "$name.ext"
  quiet openssl x509 -req -in "$name.csr" -CA "$ca.crt" -CAkey "$ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -extfile "$name.ext" -out "$name.crt" "$@"
  rm -f "$name.csr" "$name.ext"
}

server_ext='basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1\n'
client_ext='basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n'

ca ca layerserve-test-ca
ca other-ca layerserve-other-test-ca
leaf server ca localhost "$server_ext" -days 2
leaf client ca layerserve-test-client "$client_ext" -days 2
leaf client2 ca layerserve-test-client-2 "$client_ext" -days 2
leaf other-client other-ca layerserve-other-test-client "$client_ext" -days 2
leaf expired ca localhost "$server_ext" -days -1
rm -f ca.key other-ca.key
