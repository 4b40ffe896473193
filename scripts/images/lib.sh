# shellcheck shell=bash
# Shared settings for scripts/images/*.sh (sourced, not run).
#
# Everything is daemonless: images are built with buildah (chroot isolation) into a private
# containers-storage under the cache dir, so nothing touches a system-wide /var/lib/containers.

FLEXINFER_IMAGES_CACHE=${FLEXINFER_IMAGES_CACHE:-${HOME}/.cache/flexinfer/images}
# overlay where the kernel allows it, vfs otherwise (auto-detected once, see images_storage_driver).
FLEXINFER_STORAGE_DRIVER=${FLEXINFER_STORAGE_DRIVER:-}

images_log() { printf '[images %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
images_die() { images_log "error: $*"; exit 1; }

# sha256 of stdin, hex.
images_sha256() { sha256sum | cut -d' ' -f1; }

# The storage driver: overlay if a throwaway overlay mount works here, vfs otherwise.
images_storage_driver() {
  if [[ -n $FLEXINFER_STORAGE_DRIVER ]]; then echo "$FLEXINFER_STORAGE_DRIVER"; return; fi
  local t ok=vfs
  t=$(mktemp -d)
  mkdir -p "$t"/{l,u,w,m}
  if mount -t overlay overlay -o "lowerdir=$t/l,upperdir=$t/u,workdir=$t/w" "$t/m" 2>/dev/null; then
    umount "$t/m"; ok=overlay
  fi
  rm -rf "$t"
  FLEXINFER_STORAGE_DRIVER=$ok
  echo "$ok"
}

# buildah against the private storage (one store per driver: stores are not driver-portable).
bah() {
  local driver
  driver=$(images_storage_driver)
  buildah --root "$FLEXINFER_IMAGES_CACHE/storage-$driver" \
    --runroot "${XDG_RUNTIME_DIR:-/tmp}/flexinfer-buildah-$driver" \
    --storage-driver "$driver" "$@"
}

# The same store as a containers-transports reference prefix for skopeo:
#   skopeo copy "$(images_storage_ref)localhost/flexinfer/worker:dev" ...
images_storage_ref() {
  local driver
  driver=$(images_storage_driver)
  printf 'containers-storage:[%s@%s+%s]' "$driver" "$FLEXINFER_IMAGES_CACHE/storage-$driver" \
    "${XDG_RUNTIME_DIR:-/tmp}/flexinfer-buildah-$driver"
}

# Human-readable size of a file.
images_size() { du -h --apparent-size "$1" | cut -f1; }
