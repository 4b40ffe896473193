#!/usr/bin/env bash
# The GPU check of the quantization engine (docs/dev/gptq-device.md, "The card check"): on a machine with a card,
# the kernel checks against the CPU backend, whole-group solves, a full GPTQ of a generated model on the
# device and on the CPU, and the timings (the engine's host ↔ device copies, Hessian, factorisation at
# n = 4096, 11008, 21504 and block update,
# the engine's own kernels against the vendor's libraries and the CPU; a 4096 × 11008 module solve against
# the CPU). Where cuBLAS/cuSOLVER (rocBLAS/rocSOLVER) load, every check runs twice: with them, as a Job
# would, and with GPTQ_VENDOR_LIBS=off's own kernels. One run is meant to finish in under
# 5 minutes; it is stopped after GPU_CHECK_TIMEOUT seconds (default 290).
#
#   scripts/gpu-check.sh --build-only        # here: build the check (release) into .gpu-check/gpu_check
#   scripts/gpu-check.sh [gpu_check args]    # there: run it (--device auto|cuda|hip, --quick, --sizes …)
#
# The binary: $GPU_CHECK_BIN, else .gpu-check/gpu_check (built with --build-only and carried to a machine
# without cargo), else built with cargo now. The vendor libraries are loaded at run time: the driver
# (libcuda.so.1 / libamdhip64.so*) from the system; NVRTC, cuBLAS and cuSOLVER (CUDA) from $FLEXINFER_NVRTC /
# $FLEXINFER_CUBLAS / $FLEXINFER_CUSOLVER, else the first libnvrtc.so* / libcublas.so* / libcusolver.so*
# found in $GPU_CHECK_LIB_DIRS
# (colon-separated), the Python environment's nvidia wheels, /usr/local/cuda*/lib64, or the loader's cache.
# Writes $OUT/gpu-check.json (or $GPU_CHECK_JSON) with every check and timing.
# Exit status: 0 all checks passed, 1 a check failed, 2 usage or no binary, 3 no usable GPU, 124 timeout.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STAGE=$ROOT/.gpu-check

build() {
  local target=${CARGO_TARGET_DIR:-$ROOT/target}
  (cd "$ROOT" && cargo build --release -p flexinfer-quant --example gpu_check >&2)
  mkdir -p "$STAGE"
  cp "$target/release/examples/gpu_check" "$STAGE/gpu_check.tmp"
  strip --strip-debug "$STAGE/gpu_check.tmp" 2>/dev/null || true
  mv "$STAGE/gpu_check.tmp" "$STAGE/gpu_check"
  echo "$STAGE/gpu_check"
}

if [[ ${1:-} == --build-only ]]; then
  build
  exit 0
fi

BIN=${GPU_CHECK_BIN:-}
if [[ -z $BIN ]]; then
  if [[ -x $STAGE/gpu_check ]]; then
    BIN=$STAGE/gpu_check
  elif command -v cargo >/dev/null; then
    BIN=$(build)
  else
    echo "gpu-check: no gpu_check binary and no cargo here: run 'scripts/gpu-check.sh --build-only' on a machine with cargo and bring .gpu-check/ along (or set GPU_CHECK_BIN)" >&2
    exit 2
  fi
fi
[[ -x $BIN ]] || { echo "gpu-check: $BIN is not an executable" >&2; exit 2; }

# NVRTC, cuBLAS and cuSOLVER: $FLEXINFER_* or found, exported with their directories on LD_LIBRARY_PATH.
# shellcheck source=lib/gpu-libs.sh
source "$ROOT/scripts/lib/gpu-libs.sh"
echo "gpu-check: binary $BIN; NVRTC ${FLEXINFER_NVRTC:-none found}; cuBLAS ${FLEXINFER_CUBLAS:-none found}; cuSOLVER ${FLEXINFER_CUSOLVER:-none found}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

JSON=${GPU_CHECK_JSON:-${OUT:+$OUT/gpu-check.json}}
args=("$@")
[[ -n $JSON ]] && args+=(--json "$JSON")
rc=0
timeout "${GPU_CHECK_TIMEOUT:-290}" "$BIN" "${args[@]}" || rc=$?
case $rc in
  0) echo "gpu-check: all checks passed" ;;
  3) echo "gpu-check: no usable GPU (see the reasons above)" ;;
  124) echo "gpu-check: stopped after ${GPU_CHECK_TIMEOUT:-290} s" ;;
  *) echo "gpu-check: failed (exit $rc)" ;;
esac
exit "$rc"
