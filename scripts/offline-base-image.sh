#!/usr/bin/env bash
# Prepare an offline `docker compose build` on a machine that reaches no image registry, only a Debian apt
# mirror and PyPI (as CI machines here do):
#   1. the base image the Dockerfile's FROM line names (python:3.11-slim-bookworm), made locally with
#      debootstrap (Debian bookworm minbase + python3, venv, ca-certificates) and `docker import`;
#   2. docker/extra-ca/: the host's extra certificate authorities (/usr/local/share/ca-certificates/*.crt),
#      so pip inside the build trusts the same TLS interception the host does;
#   3. docker/wheels/: the pinned CPU torch wheel that pip finds here through PIP_FIND_LINKS, so the build
#      does not download the multi-GB CUDA build.
# Users elsewhere need none of this: `docker compose build` pulls the real base image.
#
# Usage: scripts/offline-base-image.sh [--force]   (needs root, docker and debootstrap)
# Env:   BASE_IMAGE (default: the Dockerfile's first FROM), DEBIAN_MIRROR (default: the host's apt mirror),
#        TORCH_VERSION (default 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'offline-base-image: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

force=0
[[ "${1:-}" == "--force" ]] && force=1

base_image=${BASE_IMAGE:-$(awk 'toupper($1) == "FROM" { print $2; exit }' Dockerfile)}
[[ -n "$base_image" ]] || die "cannot read the base image name from Dockerfile's first FROM line"
torch_version=${TORCH_VERSION:-2.13.0}

# --- 1. the extra certificate authorities -------------------------------------------------------------
shopt -s nullglob
cas=(/usr/local/share/ca-certificates/*.crt)
if ((${#cas[@]})); then
    cp -f "${cas[@]}" docker/extra-ca/
    say "copied ${#cas[@]} extra CA certificate(s) into docker/extra-ca/"
else
    say "no extra CA certificates in /usr/local/share/ca-certificates; docker/extra-ca/ stays empty"
fi

# --- 2. the CPU torch wheel -----------------------------------------------------------------------------
wheel=""
for dir in ${PIP_FIND_LINKS:-}; do
    for candidate in "$dir"/torch-"$torch_version"[+-]*.whl; do wheel=$candidate; done
done
if [[ -n "$wheel" ]]; then
    if [[ ! -f "docker/wheels/$(basename "$wheel")" ]]; then
        rm -f docker/wheels/torch-*.whl
        cp -f "$wheel" docker/wheels/
    fi
    say "torch wheel for the build: docker/wheels/$(basename "$wheel")"
else
    say "no torch-$torch_version wheel under PIP_FIND_LINKS='${PIP_FIND_LINKS:-}'; the build downloads torch " \
        "from the index in TORCH_INDEX_URL (default: PyTorch's CPU index)"
fi

# --- 3. the base image ----------------------------------------------------------------------------------
command -v docker >/dev/null || die "docker is not installed (apt-get install -y docker.io)"
docker info >/dev/null 2>&1 || die "the Docker daemon does not answer (start dockerd first)"
if docker image inspect "$base_image" >/dev/null 2>&1 && ((force == 0)); then
    say "base image $base_image already exists (--force rebuilds it)"
    exit 0
fi
command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install -y debootstrap)"
[[ $(id -u) == 0 ]] || die "debootstrap needs root"

mirror=${DEBIAN_MIRROR:-}
if [[ -z "$mirror" ]]; then
    mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
fi
if [[ -z "$mirror" ]]; then
    mirror=$(awk '$1 == "deb" && $0 !~ /security/ { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
fi
mirror=${mirror:-http://deb.debian.org/debian}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
start=$(date +%s)
say "debootstrap bookworm (minbase + python3) from $mirror; about a minute"
debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2
    die "debootstrap failed (log above)"
}
# What a slim image leaves out: package lists and caches, documentation, man pages, locales but C.UTF-8.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/var/log/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
find "$rootfs"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
printf 'deb %s bookworm main\n' "$mirror" >"$rootfs"/etc/apt/sources.list
mkdir -p "$rootfs"/usr/local/share/ca-certificates

say "importing it as $base_image"
tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    --message "debootstrap bookworm minbase + python3 (offline stand-in for $base_image)" \
    - "$base_image" >/dev/null
say "made $base_image ($(docker image inspect -f '{{.Size}}' "$base_image" | awk '{ printf "%.0f MB", $1/1e6 }')) in $(($(date +%s) - start))s"
