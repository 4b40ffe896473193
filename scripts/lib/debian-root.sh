# Shared by the scripts that build a Debian root with mmdebstrap (scripts/hip/build-code-objects.sh,
# scripts/gguf/llamacpp-root.sh). Source it after defining log() and die() and setting ROOT_DIR.

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
