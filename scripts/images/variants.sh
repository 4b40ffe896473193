# shellcheck shell=bash
# The worker image's variants (sourced by build.sh, verify.sh and deploy-quantizer.sh, not run).
#
# Every variant holds the same flexinfer-worker binary; they differ in the base (the runtime libraries the
# GPU sessions of crates/flexinfer-quant/src/device/ load with dlopen) and their labels. The HIP code objects
# (gfx1100 and gfx906, scripts/hip/build-code-objects.sh) are embedded in that binary at build time
# (crates/flexinfer-quant/build.rs); build.sh checks that the binary of a ROCm variant embeds its target.
#
#   cpu            the default worker image, unchanged: bookworm base (glibc, libgcc), tag TAG
#   cuda           trixie + non-free libnvrtc12 (NVRTC 12.4: compute_50 … compute_90), libcublas12 and
#                  libcusolver11 (CUDA 12.4); libcuda.so.1 is the host driver's, mounted by the NVIDIA
#                  container runtime, never shipped; tag TAG-cuda
#   rocm-gfx1100   trixie + libamdhip64-5 (HIP 5.7.1) and its dependencies (HSA runtime, comgr + LLVM 17),
#                  librocblas0 and librocsolver0 (5.5.1, with gfx1100 and gfx906 code); tag TAG-rocm-gfx1100
#   rocm-gfx906    the same base and binary; tag TAG-rocm-gfx906 (one image name per architecture)
# The BLAS and solver libraries are what the GPU session loads for GPTQ_VENDOR_LIBS=auto (the default); a
# session without them runs its own kernels.

IMAGES_VARIANTS=(cpu cuda rocm-gfx1100 rocm-gfx906)

# images_variant_valid V: exit 0 when V is a variant.
images_variant_valid() {
  local v
  for v in "${IMAGES_VARIANTS[@]}"; do [[ $1 == "$v" ]] && return 0; done
  return 1
}

# images_variant_tag TAG V: the tag of variant V's image (cpu keeps TAG: it is the plain worker image).
images_variant_tag() {
  if [[ $2 == cpu ]]; then echo "$1"; else echo "$1-$2"; fi
}

# images_variant_base_env V: the base.sh environment of variant V, one NAME=value per line (empty for cpu:
# base.sh's defaults). Variants with the same lines share one cached base.
images_variant_base_env() {
  case $1 in
    cpu) ;;
    cuda)
      printf '%s\n' BASE_SUITE=trixie BASE_FLAVOR=cuda "BASE_COMPONENTS=main non-free" \
        BASE_PACKAGES=libc6,libgcc-s1,libnvrtc12,libcublas12,libcusolver11 \
        "BASE_DESCRIPTION=glibc, libgcc, NVRTC 12, cuBLAS, cuSOLVER (non-free), CA certificates, nonroot 65532" ;;
    rocm-*)
      printf '%s\n' BASE_SUITE=trixie BASE_FLAVOR=rocm \
        BASE_PACKAGES=libc6,libgcc-s1,libamdhip64-5,librocblas0,librocsolver0 \
        "BASE_DESCRIPTION=glibc, libgcc, HIP runtime, rocBLAS, rocSOLVER, CA certificates, nonroot 65532" ;;
    *) return 1 ;;
  esac
}

# images_variant_gfx V: the AMD target variant V is for, whose code object its binary must embed (nothing for
# cpu and cuda).
images_variant_gfx() {
  case $1 in rocm-*) echo "${1#rocm-}" ;; esac
}

# images_variant_runtime V: the packages whose versions the image names in its dev.flexinfer.runtime label
# and that verify.sh checks, and the library (soname) the session dlopens from it.
images_variant_runtime() {
  case $1 in
    cuda) echo "libnvrtc12 libnvrtc.so.12" ;;
    rocm-*) echo "libamdhip64-5 libamdhip64.so.5" ;;
  esac
}

# images_variant_math V: the vendor BLAS and solver packages of variant V, one "package soname" per line
# (named with their versions in the dev.flexinfer.math label; verify.sh checks each soname resolves).
images_variant_math() {
  case $1 in
    cuda) printf '%s\n' "libcublas12 libcublas.so.12" "libcusolver11 libcusolver.so.11" ;;
    rocm-*) printf '%s\n' "librocblas0 librocblas.so.0" "librocsolver0 librocsolver.so.0" ;;
  esac
}

# images_arch_variant ARCH: the variant for a GPUProfile architecture (deploy-quantizer.sh): gfx1100 and
# gfx906 -> their ROCm variant, any sm_XX -> cuda (NVRTC compiles for the card at run time). Other AMD
# targets have no code object: nothing is printed and the status is 1.
images_arch_variant() {
  case $1 in
    gfx1100 | gfx906) echo "rocm-$1" ;;
    sm_*) echo cuda ;;
    *) return 1 ;;
  esac
}

# The llama.cpp serving images (build/llamacpp.Dockerfile, scripts/images/base-llamacpp.sh): flavors cpu (tag TAG),
# vulkan (TAG-vulkan) and rocm (TAG-rocm), built by build.sh --only llamacpp, llamacpp-vulkan, llamacpp-rocm.
IMAGES_LLAMACPP_FLAVORS=(cpu vulkan rocm)

# images_llamacpp_flavor_valid F: exit 0 when F is a llama.cpp flavor.
images_llamacpp_flavor_valid() {
  local f
  for f in "${IMAGES_LLAMACPP_FLAVORS[@]}"; do [[ $1 == "$f" ]] && return 0; done
  return 1
}

# images_llamacpp_labels FLAVOR: "LABEL PACKAGE..." lines; build.sh sets dev.flexinfer.LABEL to the packages with
# their versions in the base (PACKAGE=VERSION,…), verify.sh checks them.
images_llamacpp_labels() {
  echo "llamacpp llama.cpp-tools libllama0 libggml0"
  case $1 in
    vulkan) echo "runtime libggml0-backend-vulkan libvulkan1 mesa-vulkan-drivers" ;;
    rocm)
      echo "runtime libggml0-backend-hip libamdhip64-6 libhsa-runtime64-1"
      echo "math librocblas4 libhipblas2" ;;
  esac
}

# images_llamacpp_backends FLAVOR: the ggml backend libraries (file names under ggml/backends0) the flavor's image
# must hold, each loaded by verify.sh with the image's own loader.
images_llamacpp_backends() {
  echo libggml-cpu-x64.so
  case $1 in
    vulkan) echo libggml-vulkan.so ;;
    rocm) echo libggml-hip.so ;;
  esac
}
