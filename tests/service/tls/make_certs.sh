#!/usr/bin/env bash
# Regenerates the TLS test fixtures: a test CA, a server certificate for
# 127.0.0.1 / localhost signed by it, and an unrelated CA that must be refused.
# Test-only keys: never use them for anything else.
#   bash tests/service/tls/make_certs.sh
set -euo pipefail
cd "$(dirname "$0")"
days=36500
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout "$tmp/ca.key" -out ca.pem -days "$days" -subj "/CN=jaxfeed test CA"
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout server.key -out "$tmp/server.csr" -subj "/CN=localhost"
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n' > "$tmp/ext"
openssl x509 -req -in "$tmp/server.csr" -CA ca.pem -CAkey "$tmp/ca.key" \
  -CAcreateserial -CAserial "$tmp/ca.srl" -out server.pem -days "$days" -extfile "$tmp/ext"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout "$tmp/other.key" -out other_ca.pem -days "$days" -subj "/CN=unrelated CA"
