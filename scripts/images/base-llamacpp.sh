#!/usr/bin/env bash
# Build (once per machine) the root filesystem of the llama.cpp serving images (build/llamacpp.Dockerfile) from
# Debian sid packages with mmdebstrap, and import it into the private buildah store as
# localhost/flexinfer/base:sid-llamacpp[-FLAVOR]-<hash>.
#
#   bash scripts/images/base-llamacpp.sh                          # CPU; prints the image name on stdout
#   LLAMACPP_FLAVOR=vulkan bash scripts/images/base-llamacpp.sh   # + ggml's Vulkan backend and Mesa's drivers
#   LLAMACPP_FLAVOR=rocm bash scripts/images/base-llamacpp.sh     # + ggml's HIP backend (HIP runtime, rocBLAS)
#   BASE_REBUILD=1 …                                               # ignore the cached archive
#
# What the root holds: llama.cpp-tools (llama-server and the other tools), libllama0, libggml0 with its CPU
# backends (pinned below, the versions scripts/gguf/llamacpp-root.sh uses), glibc and the C++ runtime, the CA
# bundle, passwd/group with nonroot 65532 (base-customize.sh, as in the other images), /app/llama-server (a link
# to /usr/bin/llama-server: the path the Model controller's command line and the upstream image use), and for
# the controller's "serve a directory's first .gguf" command line /bin/sh (dash), find (findutils), sort and
# head (links to busybox: coreutils would add ~20 MB for two commands). No apt, no dpkg database.
#
# Not base.sh: sid has no -updates and -security suites, the mirror's sid InRelease is past its Valid-Until
# date (apt needs Acquire::Check-Valid-Until "false", LLAMACPP_APTOPTS), llama.cpp-tools' Depends (debconf,
# wget) only serve its maintainer scripts, and base.sh's recipe hash covers its own text, so teaching it these
# would rebuild every worker base.
#
# Cache: $FLEXINFER_IMAGES_CACHE/base-sid-llamacpp[-FLAVOR]-<hash>.tar.zst, with .packages (package version)
# and, for rocm, .gfx-targets (the AMD targets ggml's HIP backend carries code for, read from the library by
# hip-offload-targets.py). <hash> covers the flavor, mirror, apt options, package lists, SOURCE_DATE_EPOCH and
# the scripts. The unpinned packages (glibc, Mesa, ROCm) are whatever sid served when the archive was built.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/images/lib.sh
. "$here/lib.sh"

LLAMACPP_FLAVOR=${LLAMACPP_FLAVOR:-cpu}
BASE_ARCH=${BASE_ARCH:-$(dpkg --print-architecture)}
BASE_MIRROR=${BASE_MIRROR:-$(python3 "$here/apt-mirror.py" sid 2>/dev/null)} || images_die "no mirror for sid"
# llama.cpp 0.7.0 and ggml 0.27.0 as in sid (scripts/gguf/llamacpp-root.sh pins the same). When sid moves on,
# the mirror stops serving these versions and mmdebstrap fails: move the pins in both scripts then.
LLAMACPP_VERSION="1:0.7.0+dfsg-2"
GGML_VERSION="0.27.0-1"
# Extracted with their dependencies.
packages="libllama0=$LLAMACPP_VERSION,libggml0=$GGML_VERSION,findutils,busybox"
# Extracted without their dependencies (base-customize.sh): base-files' (awk), ca-certificates' (openssl,
# debconf), dash's (debianutils) and llama.cpp-tools' own (debconf, wget; its libraries are libllama0's) serve
# maintainer scripts only, which never run here.
nodeps="base-files netbase ca-certificates dash llama.cpp-tools=$LLAMACPP_VERSION"
case $LLAMACPP_FLAVOR in
  cpu) description="llama.cpp $LLAMACPP_VERSION, ggml $GGML_VERSION (CPU)" ;;
  vulkan)
    # the Vulkan loader comes with the backend; Mesa's ICDs: radv (AMD), anv (Intel), lavapipe (CPU)
    packages+=",libggml0-backend-vulkan=$GGML_VERSION,mesa-vulkan-drivers"
    description="llama.cpp $LLAMACPP_VERSION, ggml $GGML_VERSION (CPU, Vulkan: Mesa)" ;;
  rocm)
    packages+=",libggml0-backend-hip=$GGML_VERSION"
    description="llama.cpp $LLAMACPP_VERSION, ggml $GGML_VERSION (CPU, HIP: ROCm, rocBLAS)" ;;
  *) images_die "LLAMACPP_FLAVOR: no flavor $LLAMACPP_FLAVOR (cpu, vulkan, rocm)" ;;
esac
LLAMACPP_APTOPTS=${LLAMACPP_APTOPTS:-Acquire::Check-Valid-Until \"false\"}
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1735689600} # 2025-01-01T00:00:00Z, as base.sh
export SOURCE_DATE_EPOCH
BASE_NODEPS=$nodeps
export BASE_NODEPS
command -v zstd >/dev/null || images_die "zstd not installed (apt-get install zstd)"

recipe() {
  printf 'flavor=%s\narch=%s\nmirror=%s\naptopts=%s\npackages=%s\nnodeps=%s\nepoch=%s\ndescription=%s\n' \
    "$LLAMACPP_FLAVOR" "$BASE_ARCH" "$BASE_MIRROR" "$LLAMACPP_APTOPTS" "$packages" "$nodeps" \
    "$SOURCE_DATE_EPOCH" "$description"
  cat "$here/base-llamacpp.sh" "$here/base-customize.sh" "$here/apt-mirror.py" "$here/hip-offload-targets.py"
}
hash=$(recipe | images_sha256 | cut -c1-12)
id=sid-llamacpp
[[ $LLAMACPP_FLAVOR == cpu ]] || id+=-$LLAMACPP_FLAVOR
name=localhost/flexinfer/base:$id-$hash
archive=$FLEXINFER_IMAGES_CACHE/base-$id-$hash.tar.zst
mkdir -p "$FLEXINFER_IMAGES_CACHE"

exec 9>"$FLEXINFER_IMAGES_CACHE/.base.lock"
flock 9

if [[ ${BASE_REBUILD:-0} == 1 ]]; then rm -f "$archive"; bah rmi -f "$name" >/dev/null 2>&1 || true; fi

if [[ ! -s $archive ]]; then
  command -v mmdebstrap >/dev/null || images_die "mmdebstrap not installed (apt-get install mmdebstrap)"
  [[ $(id -u) == 0 ]] || images_die "base-llamacpp.sh needs root (mmdebstrap root mode, file ownership)"
  images_log "building base rootfs $id ($packages + nodeps $nodeps) from $BASE_MIRROR sid -> $archive"
  t0=$(date +%s)
  work=$(mktemp -d "$FLEXINFER_IMAGES_CACHE/.base-XXXXXX")
  trap 'rm -rf "$work"' EXIT
  # its own mount namespace: nothing mmdebstrap mounts outlives it
  unshare --mount --propagation private -- mmdebstrap --quiet --mode=root --variant=extract \
    --architectures="$BASE_ARCH" --aptopt="$LLAMACPP_APTOPTS" --include="$packages" \
    --extract-hook="$here/base-customize.sh \"\$1\"" \
    sid "$work/rootfs" "deb $BASE_MIRROR sid main" >&2 \
    || images_die "mmdebstrap failed (mirror $BASE_MIRROR; if sid no longer has llama.cpp $LLAMACPP_VERSION / ggml $GGML_VERSION, move the pins in $0)"
  r=$work/rootfs
  rm -rf "$r"/etc/apt "$r"/var/lib/apt "$r"/var/cache/apt "$r"/var/log/apt "$r"/var/cache/ldconfig \
    "$r"/etc/dpkg "$r"/var/lib/dpkg/{info,available,status,lock,lock-frontend,triggers,updates} \
    "$r"/etc/machine-id "$r"/var/log/*.log
  find "$r/dev" -mindepth 1 -delete
  for f in usr/bin/llama-server usr/bin/sh usr/bin/find usr/bin/busybox; do
    [[ -x $r/$f ]] || images_die "$id: no /$f in the root"
  done
  [[ -L $r/bin && $(readlink "$r/bin") == usr/bin ]] || images_die "$id: /bin is not a link to usr/bin"
  install -d -m 0755 "$r/app"
  ln -s /usr/bin/llama-server "$r/app/llama-server"
  for a in sort head; do [[ -e $r/usr/bin/$a ]] || ln -s busybox "$r/usr/bin/$a"; done
  find "$r/var/lib/dpkg/status.d" -type f -printf '%f\n' | LC_ALL=C sort | while read -r p; do
    printf '%s %s\n' "$p" "$(sed -n 's/^Version: //p' "$r/var/lib/dpkg/status.d/$p")"
  done > "$work/packages"
  if [[ $LLAMACPP_FLAVOR == rocm ]]; then
    hip=$(find "$r/usr/lib" -name libggml-hip.so | head -1)
    [[ -n $hip ]] || images_die "$id: no libggml-hip.so in the root"
    python3 "$here/hip-offload-targets.py" "$hip" > "$work/gfx-targets" || images_die "$id: reading the gfx targets of $hip failed"
    images_log "ggml's HIP backend carries code for: $(paste -sd' ' "$work/gfx-targets")"
  fi
  tar --create --directory "$r" --sort=name --numeric-owner \
    --mtime="@$SOURCE_DATE_EPOCH" --clamp-mtime --format=pax \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime . \
    | zstd --quiet -T0 -3 -o "$work/base.tar.zst"
  rm -rf "$r" # before the archive moves: the rocm root is ~5.5 GB
  [[ ! -f $work/gfx-targets ]] || mv "$work/gfx-targets" "${archive%.tar.zst}.gfx-targets"
  mv "$work/packages" "${archive%.tar.zst}.packages"
  mv "$work/base.tar.zst" "$archive"
  images_log "base rootfs built in $(($(date +%s) - t0)) s: $(images_size "$archive") compressed ($(wc -l < "${archive%.tar.zst}.packages") packages)"
else
  images_log "base rootfs cached: $archive"
fi

# Older recipes of this flavor: dead weight.
for old in "$FLEXINFER_IMAGES_CACHE/base-$id"-*.tar.zst; do
  [[ -e $old && $old != "$archive" && ${old##*/} =~ ^base-$id-[0-9a-f]{12}\.tar\.zst$ ]] || continue
  images_log "removing the archive of an older recipe: $old"
  rm -f "$old" "${old%.tar.zst}.packages" "${old%.tar.zst}.gfx-targets"
done
bah images --format '{{.Name}}:{{.Tag}}' | while read -r old; do
  [[ $old =~ ^localhost/flexinfer/base:$id-[0-9a-f]{12}$ && $old != "$name" ]] || continue
  bah rmi "$old" >/dev/null 2>&1 || true
done

if ! bah inspect --type image "$name" >/dev/null 2>&1; then
  images_log "importing $archive as $name"
  ctx=$(mktemp -d "$FLEXINFER_IMAGES_CACHE/.ctx-XXXXXX")
  ln "$archive" "$ctx/base.tar.zst" 2>/dev/null || cp "$archive" "$ctx/base.tar.zst"
  cat > "$ctx/Containerfile" <<C
FROM scratch
ADD base.tar.zst /
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
LABEL org.opencontainers.image.title="flexinfer llama.cpp base" \
      org.opencontainers.image.description="Debian sid: $description, CA certificates, nonroot 65532" \
      dev.flexinfer.base.recipe="$hash"
USER 65532:65532
WORKDIR /home/nonroot
C
  bah bud --quiet --isolation chroot --pull=never --timestamp "$SOURCE_DATE_EPOCH" \
    --identity-label=false -f "$ctx/Containerfile" -t "$name" "$ctx" >/dev/null
  rm -rf "$ctx"
fi
echo "$name"
