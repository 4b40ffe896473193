#!/usr/bin/env bash
# Build (once, cached) the two images the real node needs without any registry:
#   localhost/pause:local   - the pod sandbox image (static pause.c)
#   localhost/busybox:local - a static busybox with /bin/sh and the applets, for tests
# as docker-archives in $TESTENV_IMAGES (default ~/.cache/testenv/node-images). Prints that dir.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${TESTENV_IMAGES:-$HOME/.cache/testenv/node-images}; mkdir -p "$OUT"
BB=/bin/busybox
# The cache key: the pause source and the busybox binary; rebuild when either changes.
KEY=$( { sha256sum "$HERE/pause.c" "$HERE/images.sh"; sha256sum "$BB"; } | sha256sum | cut -c1-16)
if [ -f "$OUT/pause.tar" ] && [ -f "$OUT/busybox.tar" ] && [ "$(cat "$OUT/key" 2>/dev/null)" = "$KEY" ]; then
  echo "$OUT"; exit 0
fi
for t in gcc umoci skopeo; do command -v $t >/dev/null || { echo "images.sh: $t missing (scripts/install-deps.sh)" >&2; exit 1; }; done
[ -x "$BB" ] && ! ldd "$BB" >/dev/null 2>&1 || { echo "images.sh: need a static busybox at $BB (apt-get install busybox-static)" >&2; exit 1; }
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
# image NAME TAG ENTRYPOINT FILL: an OCI image with one layer, filled by the function FILL ROOTFS.
image() { local name=$1 tag=$2 entry=$3 fill=$4
  umoci init --layout "$T/$name" && umoci new --image "$T/$name:$tag"
  umoci unpack --image "$T/$name:$tag" "$T/$name.b" >/dev/null
  "$fill" "$T/$name.b/rootfs"
  umoci repack --image "$T/$name:$tag" "$T/$name.b" >/dev/null
  umoci config --image "$T/$name:$tag" --os linux --architecture amd64 --config.entrypoint "$entry" \
    --config.env PATH=/bin:/usr/bin:/sbin:/usr/sbin
  skopeo copy --quiet "oci:$T/$name:$tag" "docker-archive:$T/$name.tar:localhost/$name:$tag"
  cp "$T/$name.tar" "$OUT/$name.tar.$$" && mv "$OUT/$name.tar.$$" "$OUT/$name.tar"; }   # atomic for concurrent builds
fill_pause() { gcc -static -O2 -s -o "$1/pause" "$HERE/pause.c"; }
fill_busybox() { mkdir -p "$1/bin" "$1/tmp" "$1/etc"; chmod 1777 "$1/tmp"; cp "$BB" "$1/bin/busybox"
  for a in $("$BB" --list); do [ "$a" = busybox ] || ln -sf busybox "$1/bin/$a"; done
  printf 'root:x:0:0:root:/root:/bin/sh\nnonroot:x:65532:65532:nonroot:/home/nonroot:/bin/sh\n' > "$1/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' > "$1/etc/group"; }
image pause local /pause fill_pause >&2          # stdout is only for the printed dir
image busybox local /bin/sh fill_busybox >&2
echo "$KEY" > "$OUT/key"; echo "$OUT"
