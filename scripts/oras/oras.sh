#!/usr/bin/env bash
# The `oras` CLI, built from the Go module proxy (oras.land/oras) and cached by version under
# ~/.cache/flexinfer/tools/oras-<version>, for the test that pulls a published artifact with it
# (crates/flexinfer-worker/tests/publish_consumers.rs reads FLEXINFER_ORAS). A cold build (module download and
# compile, empty Go module and build caches) took 26-44 s on 2 cores; a warm run only checks the cached binary.
# Prints the binary's path on stdout; everything else goes to stderr.
set -euo pipefail
ORAS_VERSION=${ORAS_VERSION:-1.3.6}
dir="$HOME/.cache/flexinfer/tools/oras-$ORAS_VERSION"
bin="$dir/oras"
# The version check reads oras' whole output first: `oras version | grep -q` under pipefail fails whenever grep exits
# before oras has written its last line (SIGPIPE), which a loaded machine makes likely.
reports_version() { local v; v=$("$bin" version 2>/dev/null) || return 1; grep -qx "Version: *$ORAS_VERSION" <<<"$v"; }
if ! reports_version; then
  command -v go >/dev/null || { echo "oras: go is not on PATH (Go >= 1.24 and the module proxy are needed to build oras $ORAS_VERSION)" >&2; exit 1; }
  echo "oras: go install oras.land/oras/cmd/oras@v$ORAS_VERSION into $dir" >&2
  rm -rf "$dir"; mkdir -p "$dir"
  GOBIN="$dir" GOTOOLCHAIN=${GOTOOLCHAIN:-local} CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -trimpath" \
    go install -ldflags "-s -w" "oras.land/oras/cmd/oras@v$ORAS_VERSION" >&2 \
    || { echo "oras: building oras.land/oras/cmd/oras@v$ORAS_VERSION failed (is the Go module proxy reachable? $(go env GOPROXY))" >&2; exit 1; }
  reports_version \
    || { echo "oras: $bin does not report version $ORAS_VERSION" >&2; "$bin" version >&2 || true; exit 1; }
fi
echo "$bin"
