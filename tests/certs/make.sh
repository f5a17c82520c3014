#!/usr/bin/env bash
# Regenerates the test-only certificates used by the TLS tests (never use them elsewhere):
# a CA, a server certificate for localhost / 127.0.0.1 / ::1, a client certificate, and an
# unrelated CA with its own server certificate (for "wrong CA" tests).
set -euo pipefail
cd "$(dirname "$0")"
days=36500
ext_server="subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1
basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth"
ext_client="basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
ca() {
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days $days \
    -subj "/CN=$2" -keyout "$1.key" -out "$1.pem" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
}
leaf() { # name ca cn ext
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$3" \
    -keyout "$1.key" -out "$1.csr" 2>/dev/null
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -days $days \
    -out "$1.pem" -extfile <(printf '%s\n' "$4") 2>/dev/null
  rm -f "$1.csr"
}
ca ca "torchft test CA"
leaf server ca localhost "$ext_server"
leaf client ca "torchft test client" "$ext_client"
ca other-ca "unrelated test CA"
leaf other-server other-ca localhost "$ext_server"
rm -f ./*.srl
# The keys are only ever read by the tests; PKCS#8 is what every loader accepts.
for k in *.key; do openssl pkcs8 -topk8 -nocrypt -in "$k" -out "$k.tmp" && mv "$k.tmp" "$k"; done
