#!/usr/bin/env bash
# Build the OpenTelemetry Collector that the OTLP tests send to (tests/otelcol: main.go names the
# components, go.mod and go.sum pin the Collector's modules) into a machine cache, once per
# version of those files: a binary whose name holds their hash is not built again. The Go module
# cache (GOMODCACHE) keeps the downloaded modules between builds. tests/otelcol_server.py finds
# the binary at the same place.
set -euo pipefail
cd "$(dirname "$0")/.."

src=tests/otelcol
cache="${WMWATCH_BIN_CACHE:-$HOME/.cache/wmwatch/bin}"
command -v go >/dev/null 2>&1 || {
    echo "build_otelcol: go is missing; install Go 1.26 or later and run again" >&2
    exit 1
}
version="$(awk '$1 == "go.opentelemetry.io/collector/otelcol" {print $2}' "$src/go.mod")"
hash="$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-12)"
target="$cache/wmwatch-otelcol-$version-$hash"
if [ -x "$target" ]; then
    echo "== otelcol: cached in $target"
    exit 0
fi
echo "== otelcol: building $version into $target (a few minutes, once per version)"
mkdir -p "$cache"
# built beside the target and moved in whole, so a cut-off build never looks complete
staging="$(mktemp "$cache/.wmwatch-otelcol.XXXXXX")"
# -mod=readonly: go.mod and go.sum as committed, never rewritten by a build
if ! (cd "$src" && GOFLAGS=-buildvcs=false go build -mod=readonly -trimpath -ldflags='-s -w' \
        -o "$staging" .); then
    rm -f "$staging"
    echo "build_otelcol: the Collector did not build; check access to the Go module proxy" >&2
    exit 1
fi
chmod 0755 "$staging"
mv "$staging" "$target"
echo "== otelcol: built $target"
