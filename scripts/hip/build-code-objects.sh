#!/usr/bin/env bash
# Build the HIP code objects of crates/flexinfer-quant/kernels/gptq.cu for gfx1100 and gfx906 with Debian
# trixie's hipcc, inside a trixie root made with mmdebstrap (the host release is not changed).
#
#   export FLEXINFER_HIP_CODE_OBJECTS=$(bash scripts/hip/build-code-objects.sh [OUT_DIR])
#
# Prints the output directory on stdout (everything else goes to stderr). It holds, per target T:
#   gptq-T.hsaco   the code object (hipcc --genco, raw ELF)
#   gptq-T.s       llvm-objdump -d of it (tests/hip_code_objects.rs checks it for fused multiply-adds)
#   gptq-T.log     the compiler's output
# and build-info.txt (root key, package versions, flags). Any target that fails to compile or disassemble
# makes the script exit non-zero, naming the target and showing the compiler's output.
#
# Caches (both created atomically: built in a temporary directory, then renamed):
#   ~/.cache/flexinfer/hip-root-<key>                      the trixie root; <key> covers the suite, variant,
#                                                           package list and the pinned versions below
#   ~/.cache/flexinfer/hip-code-objects/<hash>             default OUT_DIR; <hash> covers gptq.cu, the root
#                                                           key, the targets and the compiler flags
# Needs root (mmdebstrap's root mode, chroot). Env: FLEXINFER_DEBIAN_MIRROR (default: the host's apt mirror),
# FLEXINFER_CACHE (default ~/.cache/flexinfer).
set -euo pipefail
ROOT_DIR=$(cd "$(dirname "$0")/../.." && pwd)
SRC=$ROOT_DIR/crates/flexinfer-quant/kernels/gptq.cu
CACHE=${FLEXINFER_CACHE:-$HOME/.cache/flexinfer}
log() { echo "hip-build: $*" >&2; }
die() { log "$*"; exit 1; }
# shellcheck source=../lib/debian-root.sh
source "$ROOT_DIR/scripts/lib/debian-root.sh"

SUITE=trixie
VARIANT=minbase
# hipcc 5.7.1 with the ROCm 6.0 device libraries (gfx906 and gfx1100 bitcode) and LLVM 17. Pinned so that
# the cache key names what is in the root; when trixie publishes a new version the pin must be moved.
PACKAGES=(
  "hipcc=5.7.1-6+deb13u1"
  "rocm-device-libs-17=6.0+git20231212.5a852ed-2"
  "clang-17=1:17.0.6-22+b2"
  "lld-17=1:17.0.6-22+b2"
  "llvm-17=1:17.0.6-22+b2"
)
TARGETS=(gfx1100 gfx906)
# -ffp-contract=off: the same no-contraction rule as the NVRTC and host builds (the sweep kernel must form
# no FMA; it also spells its arithmetic with __fmul_rn & co.). hipcc does not include the HIP runtime header by
# itself (NVRTC declares threadIdx & co. implicitly), hence -include.
FLAGS=(--genco --no-gpu-bundle-output -O3 -ffp-contract=off -include hip/hip_runtime.h)
# For debian_root (scripts/lib/debian-root.sh); not in the root's key (the key predates this list, and
# recommends were never installed).
# shellcheck disable=SC2034
APTOPTS=('APT::Install-Recommends "false"')

[ -f "$SRC" ] || die "no kernel source at $SRC"
[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap root mode and chroot)"

ensure_mmdebstrap

mirror=$(debian_mirror "$SUITE")

sha() { sha256sum | cut -c1-16; }
root_key=$(printf '%s\n' "$SUITE" "$VARIANT" "${PACKAGES[@]}" | sha)
hipcc_version=${PACKAGES[0]#hipcc=}
HIPROOT=$CACHE/hip-root-$SUITE-hipcc${hipcc_version%%-*}-$root_key
mkdir -p "$CACHE"

debian_root "$HIPROOT" hip-root "$mirror"

hipcc_bin=/usr/bin/hipcc
objdump_bin=/usr/bin/llvm-objdump-17
[ -x "$HIPROOT$hipcc_bin" ] || die "no $hipcc_bin in $HIPROOT"
[ -x "$HIPROOT$objdump_bin" ] || die "no $objdump_bin in $HIPROOT"

src_hash=$( { sha256sum < "$SRC"; printf '%s\n' "$root_key" "${TARGETS[@]}" "${FLAGS[@]}"; } | sha)
OUT=${1:-$CACHE/hip-code-objects/$src_hash}
if [ -f "$OUT/.complete-$src_hash" ]; then
  log "code objects for this source are up to date in $OUT"
  echo "$OUT"; exit 0
fi
# OUT is replaced as a whole, so it must be empty, absent, or an earlier output of this script.
if [ -d "$OUT" ] && [ -n "$(ls -A "$OUT")" ] && ! compgen -G "$OUT/.complete-*" >/dev/null; then
  die "$OUT exists and is not an output of this script; give an empty or new directory"
fi

# Run a command in the root with /proc, /dev and a work directory bound in; the mounts live in a private
# mount namespace and vanish with it.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$SRC" "$work/gptq.cu"
in_root() {
  # shellcheck disable=SC2016
  unshare --mount --propagation private -- /bin/sh -c '
    r=$1; w=$2; shift 2
    mount -t proc proc "$r/proc" && mount --rbind /dev "$r/dev" && mkdir -p "$r/work" && mount --bind "$w" "$r/work" \
      && exec chroot "$r" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/work TMPDIR=/work "$@"' sh "$HIPROOT" "$work" "$@"
}

failed=()
for tgt in "${TARGETS[@]}"; do
  t=$(date +%s)
  if in_root sh -c 'cd /work && "$@"' sh "$hipcc_bin" "${FLAGS[@]}" --offload-arch="$tgt" \
       -o "gptq-$tgt.hsaco" gptq.cu > "$work/gptq-$tgt.log" 2>&1 \
     && [ -s "$work/gptq-$tgt.hsaco" ]; then
    if in_root "$objdump_bin" -d --mcpu="$tgt" "/work/gptq-$tgt.hsaco" > "$work/gptq-$tgt.s" 2>> "$work/gptq-$tgt.log"; then
      log "$tgt: compiled in $(( $(date +%s) - t ))s"
    else
      log "$tgt: llvm-objdump failed:"; cat "$work/gptq-$tgt.log" >&2; failed+=("$tgt")
    fi
  else
    log "$tgt: hipcc failed (${FLAGS[*]} --offload-arch=$tgt); compiler output:"
    cat "$work/gptq-$tgt.log" >&2; failed+=("$tgt")
  fi
done
[ ${#failed[@]} -eq 0 ] || die "failed targets: ${failed[*]}"

{ echo "source_sha256=$(sha256sum < "$work/gptq.cu" | cut -d' ' -f1)"
  echo "root=$HIPROOT"; echo "root_key=$root_key"; echo "mirror=$mirror"
  echo "flags=${FLAGS[*]}"; echo "targets=${TARGETS[*]}"
  echo "hipcc_version=$(in_root "$hipcc_bin" --version 2>&1 | tr '\n' ' ')"
  echo "packages:"; cat "$HIPROOT/.flexinfer-packages"; } > "$work/build-info.txt"

mkdir -p "$(dirname "$OUT")"
staged=$(mktemp -d "$(dirname "$OUT")/.staging.XXXXXX")
for tgt in "${TARGETS[@]}"; do cp "$work/gptq-$tgt".{hsaco,s,log} "$staged/"; done
cp "$work/build-info.txt" "$staged/"
touch "$staged/.complete-$src_hash"
if [ -e "$OUT" ]; then
  rm -rf "$OUT.old"; mv "$OUT" "$OUT.old"; mv "$staged" "$OUT"; rm -rf "$OUT.old"
else
  mv "$staged" "$OUT"
fi
log "code objects in $OUT"
echo "$OUT"
