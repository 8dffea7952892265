#!/usr/bin/env bash
# Build the Go digits client: generate the stubs from protos/ with protoc (protoc-gen-go and
# protoc-gen-go-grpc) into a build folder, then `go build` in GOPATH mode against the Go packages in
# GOPATH (Debian: golang-go golang-google-grpc-dev golang-google-protobuf-dev
# golang-github-golang-protobuf-1-5-dev protoc-gen-go protoc-gen-go-grpc protobuf-compiler, which install
# them under /usr/share/gocode; with protobuf's APIv1 at 1.3 instead of 1.5 the client builds but gRPC
# cannot marshal its messages). No network.
#
#   examples/go/build.sh [OUTPUT]        # default OUTPUT: examples/go/bin/digits-client
# Env: GOPATH_EXTRA (default /usr/share/gocode) where grpc and protobuf's Go sources are.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
output=$(realpath -m "${1:-$here/bin/digits-client}")

for tool in go protoc protoc-gen-go protoc-gen-go-grpc; do
    command -v "$tool" >/dev/null || { echo "build.sh: $tool is not installed" >&2; exit 1; }
done

build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
package=$build/src/pipelineclient
mkdir -p "$package"
cp "$here/main.go" "$package/"
# The protos name no Go package: map both files to pipelineclient/inference here.
maps="Minference/grpc_service.proto=pipelineclient/inference,Minference/model_config.proto=pipelineclient/inference"
protoc -I "$root/protos" \
    --go_out="$package" --go_opt=paths=source_relative,"$maps" \
    --go-grpc_out="$package" --go-grpc_opt=paths=source_relative,"$maps" \
    "$root"/protos/inference/*.proto
mkdir -p "$(dirname "$output")"
cd "$package"
GO111MODULE=off GOPATH="$build:${GOPATH_EXTRA:-/usr/share/gocode}" GOFLAGS= go build -o "$output" pipelineclient
echo "built $output"
