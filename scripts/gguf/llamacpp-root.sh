#!/usr/bin/env bash
# A Debian sid root holding the real llama.cpp (llama.cpp-tools, llama.cpp-tools-extra, libggml0 with its CPU
# backends, python3-gguf), made with mmdebstrap; the host release is not changed. sid is needed because these
# packages need glibc 2.43. Used by crates/flexinfer-quant/tests/gguf_llamacpp.rs: llama.cpp loads the GGUF
# files we write.
#
#   export FLEXINFER_LLAMACPP_ROOT=$(bash scripts/gguf/llamacpp-root.sh)
#   bash scripts/gguf/llamacpp-run.sh "$FLEXINFER_LLAMACPP_ROOT" DIR llama-cli --version
#
# Prints the root's path on stdout (everything else goes to stderr). The root holds
#   .flexinfer-packages        every installed package=version
#   .flexinfer-download-bytes  bytes of .deb downloaded to build it
#   .flexinfer-root-complete   written last
# llama.cpp's converter (convert_hf_to_gguf.py) is shipped by llama.cpp-tools but not usable here: it needs
# torch and transformers, about four times this root (docs/dev/gguf.md, "The real llama.cpp").
#
# Cache: ~/.cache/flexinfer/llamacpp-root-<version>-<key>, created atomically (built in a temporary
# directory, then renamed); <key> covers the suite, variant, apt options and the pinned package list below.
# Needs root (mmdebstrap's root mode, chroot). Env: FLEXINFER_DEBIAN_MIRROR (default: the host's apt mirror),
# FLEXINFER_CACHE (default ~/.cache/flexinfer).
set -euo pipefail
ROOT_DIR=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${FLEXINFER_CACHE:-$HOME/.cache/flexinfer}
log() { echo "llamacpp-root: $*" >&2; }
die() { log "$*"; exit 1; }
# shellcheck source=../lib/debian-root.sh
source "$ROOT_DIR/scripts/lib/debian-root.sh"

SUITE=sid
VARIANT=minbase
# llama.cpp 0.7.0 and ggml 0.27.0 as in sid. Pinned so that the cache key names what is in the root; when sid
# moves on, the mirror stops serving these versions and mmdebstrap fails: move the pins then.
PACKAGES=(
  "llama.cpp-tools=1:0.7.0+dfsg-2"
  "llama.cpp-tools-extra=1:0.7.0+dfsg-2"
  "libllama0=1:0.7.0+dfsg-2"
  "libggml0=0.27.0-1"
  "python3-gguf=1:0.7.0+dfsg-2"
)
# sid's InRelease on the mirror may be past its Valid-Until date.
APTOPTS=('Acquire::Check-Valid-Until "false"' 'APT::Install-Recommends "false"')

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap root mode and chroot)"

ensure_mmdebstrap

mirror=$(debian_mirror "$SUITE")

sha() { sha256sum | cut -c1-16; }
root_key=$(printf '%s\n' "$SUITE" "$VARIANT" "${APTOPTS[@]}" "${PACKAGES[@]}" | sha)
llama_version=${PACKAGES[0]#*=1:}
LLROOT=$CACHE/llamacpp-root-${llama_version%%+*}-$root_key
mkdir -p "$CACHE"

debian_root "$LLROOT" llamacpp-root "$mirror" "; if sid no longer has these versions, move the pins in $0"

for b in llama-cli llama-quantize llama-perplexity; do
  [ -x "$LLROOT/usr/bin/$b" ] || die "no /usr/bin/$b in $LLROOT"
done
echo "$LLROOT"
