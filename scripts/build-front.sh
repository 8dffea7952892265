#!/bin/sh
# Build the compiled front door (front/: pipeline-front, C++ on grpc++) and install it as BIN/pipeline-front.
# Usage: scripts/build-front.sh BUILD_DIR BIN [cmake options...]
# Where grpc++ or cmake is missing it installs them (as root, with apt); where it still cannot build, it says so
# in one line and exits 0: the router's Python ingress serves the gRPC port then (`--front auto`).
set -e
build=$1
bin=$2
shift 2
packages="libgrpc++-dev pkg-config cmake make g++"
have_toolchain() {
	command -v cmake >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1 && pkg-config --exists grpc++ 2>/dev/null
}
if ! have_toolchain && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
	echo "front: installing $packages (apt)"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q $packages >/dev/null 2>&1 ||
		{ apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $packages >/dev/null 2>&1; } || true
fi
if ! have_toolchain; then
	echo "front: pipeline-front not built (needs cmake, a C++ compiler and grpc++: apt-get install $packages); the Python ingress serves the gRPC port"
	exit 0
fi
cmake -S front -B "$build" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build" --parallel 2 >/dev/null || cmake --build "$build"
if ! cmp -s "$build/pipeline-front" "$bin/pipeline-front"; then
	install -m 0755 "$build/pipeline-front" "$bin/pipeline-front"
	echo "front: installed $bin/pipeline-front"
fi
