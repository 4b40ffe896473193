#!/usr/bin/env bash
# Load a locally built image into the real node's containerd, so pods can use it with
# `imagePullPolicy: Never` (or IfNotPresent):
#   scripts/testenv/load-image.sh ARCHIVE [NAME]
# ARCHIVE: a docker-archive (docker save, skopeo copy … docker-archive:…) or an OCI archive (oci-archive:…,
# buildah push … oci-archive:…). NAME: the image reference the pods use, e.g. `flexinfer/worker:dev` or
# `localhost/worker:dev`; it is stored normalized the way the kubelet resolves it (docker.io/flexinfer/worker:dev).
# Without NAME a docker-archive keeps the names it carries (RepoTags); an OCI archive needs NAME.
# Needs TESTENV_CONTAINERD_ADDRESS (printed by up.sh) or TESTENV_DIR. Prints the stored name(s).
set -euo pipefail
ARCHIVE=${1:?usage: load-image.sh ARCHIVE [NAME]}; NAME=${2:-}
A=${TESTENV_CONTAINERD_ADDRESS:-${TESTENV_DIR:?set TESTENV_CONTAINERD_ADDRESS or TESTENV_DIR (source up.sh output)}/node/containerd/containerd.sock}
[ -S "$A" ] || { echo "load-image: no containerd socket at $A (is the testenv up with its real node?)" >&2; exit 1; }
[ -f "$ARCHIVE" ] || { echo "load-image: $ARCHIVE: no such file" >&2; exit 1; }
C=(ctr --address "$A" -n k8s.io)
# Docker's normalization, as the kubelet/CRI applies it: busybox -> docker.io/library/busybox:latest.
norm() { python3 - "$1" <<'EOF'
import sys
n = sys.argv[1]
if '@' not in n and ':' not in n.rsplit('/', 1)[-1]:
    n += ':latest'
first = n.split('/', 1)[0]
if '/' not in n:
    n = 'docker.io/library/' + n
elif not ('.' in first or ':' in first or first == 'localhost'):
    n = 'docker.io/' + n
print(n)
EOF
}
members=$(tar tf "$ARCHIVE" 2>/dev/null) || { echo "load-image: $ARCHIVE is not a tar archive" >&2; exit 1; }
TMP=localhost/testenv-import-$$
if grep -qx 'manifest.json' <<<"$members"; then args=()
elif grep -qx 'index.json' <<<"$members"; then
  [ -n "$NAME" ] || { echo "load-image: $ARCHIVE is an OCI archive: give the NAME the pods use" >&2; exit 1; }
  args=(--base-name "$TMP")   # OCI refs are bare tags (`latest`): name them under a temporary base
else echo "load-image: $ARCHIVE is neither a docker-archive (manifest.json) nor an OCI archive (index.json)" >&2; exit 1; fi
# --all-platforms: keep whatever the archive has (a single-platform image is unpacked as usual);
# --digests: also name each image by its digest, which is what NAME is tagged from.
out=$("${C[@]}" images import --all-platforms --digests "${args[@]}" "$ARCHIVE")
imported=$(sed -n 's/^unpacking \(.*\) (\(sha256:[0-9a-f]*\))\.\.\.done$/\1 \2/p' <<<"$out")
[ -n "$imported" ] || { echo "load-image: ctr imported nothing from $ARCHIVE:"$'\n'"$out" >&2; exit 1; }
digests=$(awk '{print $2}' <<<"$imported" | sort -u)
temp=$(awk '$1 ~ /@sha256:/ || index($1, "'"$TMP"'") == 1 {print $1}' <<<"$imported")
if [ -n "$NAME" ]; then
  [ "$(wc -l <<<"$digests")" = 1 ] || { echo "load-image: $ARCHIVE holds several images; NAME is ambiguous" >&2
    [ -n "$temp" ] && "${C[@]}" images rm $temp >/dev/null; exit 1; }
  ref=$(norm "$NAME"); src=$(awk '$1 ~ /@sha256:/ {print $1; exit}' <<<"$imported")
  "${C[@]}" images tag --force "$src" "$ref" >/dev/null
fi
[ -n "$temp" ] && "${C[@]}" images rm $temp >/dev/null
if [ -n "$NAME" ]; then echo "$ref"; else awk '$1 !~ /@sha256:/ {print $1}' <<<"$imported"; fi
