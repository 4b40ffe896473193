# shellcheck shell=bash
# Sourced by scripts/gpu-check.sh and scripts/gpu-whole-run.sh on a machine with a card: finds the vendor
# libraries the engine loads at run time (NVRTC, cuBLAS, cuSOLVER) the way a worker image would not need to:
# $FLEXINFER_NVRTC / $FLEXINFER_CUBLAS / $FLEXINFER_CUSOLVER, else the first match in $GPU_CHECK_LIB_DIRS
# (colon-separated), the Python environment's nvidia wheels, /usr/local/cuda*/lib64, or the loader's cache;
# exports them and puts those directories on LD_LIBRARY_PATH (cuSOLVER's own dependencies sit beside it).

# Directories that may hold NVRTC and cuSOLVER.
lib_dirs() {
  local IFS=:
  for d in ${GPU_CHECK_LIB_DIRS:-}; do echo "$d"; done
  if command -v python3 >/dev/null; then
    python3 - <<'EOF' 2>/dev/null || true
import glob, os, site
roots = list(site.getsitepackages()) + [site.getusersitepackages()]
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        print(d)
EOF
  fi
  ls -d /usr/local/cuda*/lib64 /usr/local/cuda*/targets/x86_64-linux/lib 2>/dev/null || true
}

# The first file matching $1 (a glob of a library name) in those directories, else in the loader's cache.
find_lib() {
  local d f
  while read -r d; do
    for f in "$d"/$1; do
      [[ -e $f ]] && { echo "$f"; return 0; }
    done
  done < <(lib_dirs)
  ldconfig -p 2>/dev/null | awk -v p="${1%%\**}" '$1 ~ "^"p {print $NF; exit}'
}

if [[ -z ${FLEXINFER_NVRTC:-} ]]; then
  FLEXINFER_NVRTC=$(find_lib 'libnvrtc.so.[0-9]*' || true)
fi
if [[ -z ${FLEXINFER_CUSOLVER:-} ]]; then
  FLEXINFER_CUSOLVER=$(find_lib 'libcusolver.so.[0-9]*' || true)
fi
if [[ -z ${FLEXINFER_CUBLAS:-} ]]; then
  FLEXINFER_CUBLAS=$(find_lib 'libcublas.so.[0-9]*' || true)
fi
export FLEXINFER_NVRTC FLEXINFER_CUSOLVER FLEXINFER_CUBLAS
# cuSOLVER's own dependencies (cuBLAS, cuBLASLt, cuSPARSE, nvJitLink) sit beside it or in sibling wheels.
extra=$(lib_dirs | paste -sd: -)
export LD_LIBRARY_PATH=${extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
