#!/usr/bin/env bash
# The documentation site's JavaScript, served by the site itself rather than from a CDN: Mermaid (which draws
# the diagrams) is taken from its npm package at a pinned version, checked against the registry's sha512, and
# its one minified file written, with its licence on top, to docs/assets/javascripts/mermaid.min.js
# (git-ignored). `make install` and `make docs` run this; once the file is there at this version, it returns
# at once and nothing is downloaded: the site builds offline, and a reader's browser fetches nothing else.
#
#   scripts/docs-assets.sh
set -euo pipefail
cd "$(dirname "$0")/.."

version=11.12.2
integrity=sha512-n34QPDPEKmaeCG4WDMGy0OT6PSyxKCfy2pJgShP+Qow2KLrvWjclwbc3yXfSIf4BanqWEhQEpngWwNp/XhZt6w==
out=docs/assets/javascripts/mermaid.min.js
banner="/*! mermaid $version, from its npm package (MIT licence below)"

[ -s "$out" ] && [ "$(head -n 1 "$out")" = "$banner" ] && exit 0
command -v npm >/dev/null || {
    echo "docs-assets: npm is needed once to fetch mermaid $version for the documentation (apt-get install npm)" >&2
    exit 1
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "mermaid@$version" >/dev/null)
tarball="$work/mermaid-$version.tgz"
got="sha512-$(openssl dgst -sha512 -binary "$tarball" | base64 -w 0)"
[ "$got" = "$integrity" ] || { echo "docs-assets: mermaid $version does not match its pinned sha512" >&2; exit 1; }
tar -xzf "$tarball" -C "$work" package/dist/mermaid.min.js package/LICENSE
mkdir -p "$(dirname "$out")"
{
    echo "$banner"
    sed 's|\*/|* /|g' "$work/package/LICENSE"
    echo "*/"
    cat "$work/package/dist/mermaid.min.js"
} >"$out.part"
mv "$out.part" "$out"
echo "docs-assets: $out (mermaid $version)"
