#!/bin/sh
# Make a test CA and certificates for TLS on every hop (local runs, tests and compose), with openssl.
#
#   scripts/make-certs.sh [DIR] [EXTRA_SAN ...]     # DIR defaults to ./certs
#
# Writes, in DIR: ca.pem and ca-key.pem (the CA), server.pem and server-key.pem (every service's
# certificate: SANs 127.0.0.1, ::1, localhost and the compose service names router, preprocess, model,
# postprocess, plus any EXTRA_SAN given as DNS:name or IP:address), client.pem and client-key.pem (a client
# certificate for mutual TLS: the router's to call its stages, and a client's where the router asks for
# one; CN pipeline-client), and admin.pem and admin-key.pem (a client certificate with the identity
# pipeline-admin, for servers given --tls-admin-identities pipeline-admin: it may load and unload models).
# Keys are EC P-256, valid 825 days. For testing only: keep real keys out of the repository.
set -eu

dir=${1:-certs}
[ $# -gt 0 ] && shift
sans="DNS:localhost,IP:127.0.0.1,IP:::1,DNS:router,DNS:preprocess,DNS:model,DNS:postprocess"
for extra in "$@"; do
    sans="$sans,$extra"
done

mkdir -p "$dir"
cd "$dir"
umask 077

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key ca-key.pem
openssl req -x509 -new -key ca-key.pem -sha256 -days 825 -subj "/CN=pipeline test CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out ca.pem

sign() { # name, CN, extensions
    key "$1-key.pem"
    openssl req -new -key "$1-key.pem" -subj "/CN=$2" -out "$1.csr"
    printf '%s\n' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 825 -sha256 \
        -extfile "$1.ext" -out "$1.pem" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
}

sign server "pipeline" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$sans"
sign client "pipeline-client" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
sign admin "pipeline-admin" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth
subjectAltName=DNS:pipeline-admin"
rm -f ca.srl
# Certificates are public; the services (maybe another user in a container) must read the keys too.
chmod 644 ca.pem server.pem server-key.pem client.pem client-key.pem admin.pem admin-key.pem
echo "make-certs: CA, server and client certificates in $dir"
