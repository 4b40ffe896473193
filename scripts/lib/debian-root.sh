# shellcheck shell=bash
# Shared by the scripts that build a Debian root with mmdebstrap (scripts/hip/build-code-objects.sh,
# scripts/gguf/llamacpp-root.sh). Source it after defining log() and die() and setting ROOT_DIR (and, for
# debian_root, CACHE, SUITE, VARIANT, PACKAGES and APTOPTS).

# Install mmdebstrap when it is missing (Debian hosts).
ensure_mmdebstrap() {
  command -v mmdebstrap >/dev/null && return 0
  log "apt-get install mmdebstrap"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends mmdebstrap; } >&2 \
    || die "installing mmdebstrap failed"
}

# The Debian mirror for SUITE: FLEXINFER_DEBIAN_MIRROR, else the host's apt source (the same lookup as the
# images; every Debian mirror carries every suite), else deb.debian.org.
debian_mirror() {
  local m=${FLEXINFER_DEBIAN_MIRROR:-}
  [ -n "$m" ] || m=$(python3 "$ROOT_DIR/scripts/images/apt-mirror.py" "$1" 2>/dev/null || true)
  echo "${m:-http://deb.debian.org/debian}"
}

# Make the Debian root $1 once: mmdebstrap's $VARIANT of $SUITE with ${PACKAGES[@]} (and the apt options
# ${APTOPTS[@]}) from the mirror $3, built in a temporary directory $CACHE/.$2-tmp.XXXXXX and then renamed,
# so that the root is complete (marker .flexinfer-root-complete) or absent. $4 is added to the message when
# mmdebstrap fails. An existing complete root is reused.
debian_root() {
  local dest=$1 tmp_name=$2 mirror=$3 hint=${4:-} t o
  local aptopt_args=()
  if [ -f "$dest/.flexinfer-root-complete" ]; then
    log "reusing $dest"
    return 0
  fi
  tmp=$(mktemp -d "$CACHE/.$tmp_name-tmp.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  log "creating the $SUITE root ($VARIANT, ${PACKAGES[*]}) from $mirror into $dest"
  t=$(date +%s)
  for o in "${APTOPTS[@]}"; do aptopt_args+=(--aptopt="$o"); done
  # The hooks run with the root as $1: the size of the downloaded .debs (mmdebstrap deletes them afterwards)
  # and the installed versions are recorded in the root. In its own mount namespace, so that no mount it
  # makes outlives it (the temp dir is then safe to delete).
  # shellcheck disable=SC2016
  unshare --mount --propagation private -- mmdebstrap --variant="$VARIANT" --mode=root "${aptopt_args[@]}" \
    --include="$(IFS=,; echo "${PACKAGES[*]}")" \
    --customize-hook='du -sb "$1/var/cache/apt/archives" | cut -f1 > "$1/.flexinfer-download-bytes"' \
    --customize-hook='chroot "$1" dpkg-query -W -f "\${Package}=\${Version}\n" > "$1/.flexinfer-packages"' \
    "$SUITE" "$tmp/root" "$mirror" >&2 \
    || die "mmdebstrap failed (mirror $mirror, packages ${PACKAGES[*]}$hint)"
  touch "$tmp/root/.flexinfer-root-complete"
  # A concurrent run may have finished first: keep its root. (A directory without the marker cannot come
  # from a rename, but is removed all the same.)
  if [ ! -f "$dest/.flexinfer-root-complete" ]; then rm -rf "$dest"; mv "$tmp/root" "$dest"; fi
  rm -rf "$tmp"; trap - EXIT
  log "root ready in $(( $(date +%s) - t ))s: $(du -sh "$dest" | cut -f1) on disk," \
      "$(( $(cat "$dest/.flexinfer-download-bytes") / 1048576 )) MiB downloaded"
}
