#!/usr/bin/env bash
# The ModelPack validator (scripts/modelpack/validate: the CNCF ModelPack spec's own Go module,
# github.com/modelpack/model-spec at the version validate/go.mod pins, checked against validate/go.sum),
# built once into ~/.cache/flexinfer/tools/modelpack-validate-<spec version>-<hash of the sources>. The module
# zip is fetched once from the Go module proxy into the Go module cache (by version). For the test that
# validates a published artifact (crates/flexinfer-worker/tests/publish_consumers.rs reads
# FLEXINFER_MODELPACK_VALIDATE). Prints the binary's path on stdout; everything else goes to stderr.
set -euo pipefail
src=$(cd "$(dirname "$0")/validate" && pwd)
spec=$(sed -n 's#^[[:space:]]*\(require \)\{0,1\}github.com/modelpack/model-spec \(v[^ ]*\).*#\2#p' "$src/go.mod" | head -1)
[ -n "$spec" ] || { echo "modelpack-validate: no github.com/modelpack/model-spec version in $src/go.mod" >&2; exit 1; }
hash=$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-12)
dir="$HOME/.cache/flexinfer/tools/modelpack-validate-${spec#v}-$hash"
bin="$dir/modelpack-validate"
if [ ! -x "$bin" ]; then
  command -v go >/dev/null || { echo "modelpack-validate: go is not on PATH (Go >= 1.24 and the module proxy are needed)" >&2; exit 1; }
  echo "modelpack-validate: building against github.com/modelpack/model-spec $spec into $dir" >&2
  mkdir -p "$dir"
  (cd "$src" && GOTOOLCHAIN=${GOTOOLCHAIN:-local} CGO_ENABLED=0 GOFLAGS="-mod=readonly -trimpath" \
    go build -ldflags "-s -w" -o "$bin.tmp" .) >&2 \
    || { echo "modelpack-validate: go build failed (is the Go module proxy reachable? $(go env GOPROXY))" >&2; exit 1; }
  mv "$bin.tmp" "$bin"
fi
echo "$bin"
