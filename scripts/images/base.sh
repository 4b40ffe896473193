#!/usr/bin/env bash
# Build (once per machine) the FlexInfer base root filesystem from Debian packages with mmdebstrap
# and import it into the private buildah store as localhost/flexinfer/base:<id>-<hash>, <id> being
# <suite> or, with BASE_FLAVOR, <suite>-<flavor>.
#
#   bash scripts/images/base.sh            # prints the image name on stdout
#   BASE_REBUILD=1 bash scripts/images/base.sh   # ignore the cached archive (e.g. for security updates)
#   BASE_SUITE=trixie BASE_FLAVOR=rocm BASE_PACKAGES=libc6,libgcc-s1,libamdhip64-5 bash scripts/images/base.sh
#                                          # a base with more libraries (the worker's GPU variants,
#                                          # scripts/images/variants.sh; BASE_COMPONENTS="main non-free"
#                                          # for packages outside main)
#
# The archive is cached as $FLEXINFER_IMAGES_CACHE/base-<id>-<hash>.tar; <hash> covers the recipe
# (suite, flavor, components, mirrors, package lists, SOURCE_DATE_EPOCH, this script and its hook). The
# package versions are whatever the mirror served when the archive was built: see base-<id>-<hash>.packages.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/images/lib.sh
. "$here/lib.sh"

BASE_SUITE=${BASE_SUITE:-bookworm}
# A name for a package set other than the default one: each flavor has its own archive and image.
BASE_FLAVOR=${BASE_FLAVOR:-}
[[ $BASE_FLAVOR =~ ^([a-z0-9][a-z0-9.-]{0,30})?$ ]] || images_die "bad BASE_FLAVOR: $BASE_FLAVOR"
# Archive components (e.g. "main non-free" for NVIDIA's NVRTC).
BASE_COMPONENTS=${BASE_COMPONENTS:-main}
BASE_ARCH=${BASE_ARCH:-$(dpkg --print-architecture)}
# Mirrors: by default the archives the host's own apt uses (scripts/images/apt-mirror.py).
BASE_MIRROR=${BASE_MIRROR:-$(python3 "$here/apt-mirror.py" "$BASE_SUITE")} || images_die "no mirror for $BASE_SUITE"
BASE_SECURITY_MIRROR=${BASE_SECURITY_MIRROR:-$(python3 "$here/apt-mirror.py" "$BASE_SUITE-security")} \
  || images_die "no security mirror for $BASE_SUITE"
# Extracted with their dependencies (libc6 pulls libgcc-s1 and gcc-12-base), without recommends (mmdebstrap's default).
BASE_PACKAGES=${BASE_PACKAGES:-libc6,libgcc-s1}
# One line of the image's description: what the packages are for.
BASE_DESCRIPTION=${BASE_DESCRIPTION:-glibc, libgcc, CA certificates, nonroot 65532}
# Extracted without their dependencies (see base-customize.sh): base-files would pull mawk,
# ca-certificates openssl + debconf + perl-base, none of which a shell-less image can use.
BASE_NODEPS=${BASE_NODEPS:-base-files netbase ca-certificates}
# Fixed timestamp for every file and the image config: same mirror content -> same archive.
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1735689600} # 2025-01-01T00:00:00Z
export SOURCE_DATE_EPOCH BASE_NODEPS
BASE_RECIPE_VERSION=1

recipe() {
  printf 'version=%s\nsuite=%s\nflavor=%s\ncomponents=%s\narch=%s\nmirror=%s\nsecurity=%s\npackages=%s\nnodeps=%s\nepoch=%s\ndescription=%s\n' \
    "$BASE_RECIPE_VERSION" "$BASE_SUITE" "$BASE_FLAVOR" "$BASE_COMPONENTS" "$BASE_ARCH" "$BASE_MIRROR" \
    "$BASE_SECURITY_MIRROR" "$BASE_PACKAGES" "$BASE_NODEPS" "$SOURCE_DATE_EPOCH" "$BASE_DESCRIPTION"
  cat "$here/base.sh" "$here/base-customize.sh" "$here/apt-mirror.py"
}
hash=$(recipe | images_sha256 | cut -c1-12)
id=$BASE_SUITE${BASE_FLAVOR:+-$BASE_FLAVOR}
name=localhost/flexinfer/base:$id-$hash
archive=$FLEXINFER_IMAGES_CACHE/base-$id-$hash.tar
mkdir -p "$FLEXINFER_IMAGES_CACHE"

# One builder at a time per cache dir (a second concurrent run waits, then finds the cache).
exec 9>"$FLEXINFER_IMAGES_CACHE/.base.lock"
flock 9

if [[ ${BASE_REBUILD:-0} == 1 ]]; then rm -f "$archive"; bah rmi -f "$name" >/dev/null 2>&1 || true; fi

if [[ ! -s $archive ]]; then
  command -v mmdebstrap >/dev/null || images_die "mmdebstrap not installed (apt-get install mmdebstrap)"
  [[ $(id -u) == 0 ]] || images_die "base.sh needs root (mmdebstrap root mode, file ownership)"
  images_log "building base rootfs $id ($BASE_PACKAGES + nodeps $BASE_NODEPS) -> $archive"
  t0=$(date +%s)
  work=$(mktemp -d "$FLEXINFER_IMAGES_CACHE/.base-XXXXXX")
  trap 'rm -rf "$work"' EXIT
  mmdebstrap --quiet --mode=root --variant=extract --architectures="$BASE_ARCH" \
    --include="$BASE_PACKAGES" \
    --extract-hook="$here/base-customize.sh \"\$1\"" \
    "$BASE_SUITE" "$work/rootfs" \
    "deb $BASE_MIRROR $BASE_SUITE $BASE_COMPONENTS" \
    "deb $BASE_MIRROR $BASE_SUITE-updates $BASE_COMPONENTS" \
    "deb $BASE_SECURITY_MIRROR $BASE_SUITE-security $BASE_COMPONENTS" >&2
  r=$work/rootfs
  # What mmdebstrap leaves for its own apt: no package manager in the image.
  rm -rf "$r"/etc/apt "$r"/var/lib/apt "$r"/var/cache/apt "$r"/var/log/apt "$r"/var/cache/ldconfig \
    "$r"/etc/dpkg "$r"/var/lib/dpkg/{info,available,status,lock,lock-frontend,triggers,updates} \
    "$r"/etc/machine-id "$r"/var/log/*.log
  find "$r/dev" -mindepth 1 -delete # the runtime provides /dev
  find "$r/var/lib/dpkg/status.d" -type f -printf '%f\n' | LC_ALL=C sort | while read -r p; do
    printf '%s %s\n' "$p" "$(sed -n 's/^Version: //p' "$r/var/lib/dpkg/status.d/$p")"
  done > "$work/packages"
  tar --create --file "$work/base.tar" --directory "$r" --sort=name --numeric-owner \
    --mtime="@$SOURCE_DATE_EPOCH" --clamp-mtime --format=pax \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime .
  mv "$work/packages" "${archive%.tar}.packages"
  mv "$work/base.tar" "$archive"
  images_log "base rootfs built in $(($(date +%s) - t0)) s: $(images_size "$archive") ($(wc -l < "${archive%.tar}.packages") packages)"
else
  images_log "base rootfs cached: $archive"
fi

# Older recipes of this suite and flavor: their archives and images are dead weight.
for old in "$FLEXINFER_IMAGES_CACHE/base-$id"-*.tar; do
  [[ -e $old && $old != "$archive" && ${old##*/} =~ ^base-$id-[0-9a-f]{12}\.tar$ ]] || continue
  images_log "removing the archive of an older recipe: $old"
  rm -f "$old" "${old%.tar}.packages"
done
bah images --format '{{.Name}}:{{.Tag}}' | while read -r old; do
  [[ $old =~ ^localhost/flexinfer/base:$id-[0-9a-f]{12}$ && $old != "$name" ]] || continue
  bah rmi "$old" >/dev/null 2>&1 || true # still the parent of a built image: stays until that goes
done

if ! bah inspect --type image "$name" >/dev/null 2>&1; then
  images_log "importing $archive as $name"
  ctx=$(mktemp -d "$FLEXINFER_IMAGES_CACHE/.ctx-XXXXXX")
  ln "$archive" "$ctx/base.tar" 2>/dev/null || cp "$archive" "$ctx/base.tar"
  cat > "$ctx/Containerfile" <<C
FROM scratch
ADD base.tar /
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
LABEL org.opencontainers.image.title="flexinfer base" \
      org.opencontainers.image.description="Debian $BASE_SUITE: $BASE_DESCRIPTION" \
      dev.flexinfer.base.recipe="$hash"
USER 65532:65532
WORKDIR /home/nonroot
C
  bah bud --quiet --isolation chroot --pull=never --timestamp "$SOURCE_DATE_EPOCH" \
    --identity-label=false -f "$ctx/Containerfile" -t "$name" "$ctx" >/dev/null
  rm -rf "$ctx"
fi
echo "$name"
