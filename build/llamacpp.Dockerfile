# llama.cpp serving image: Debian sid's llama-server (llama.cpp-tools 1:0.7.0+dfsg-2, ggml 0.27.0-1), what the
# Model controller runs for `backend: llamacpp` (docs/user/serving.md). /app/llama-server is the path of the
# upstream image (ghcr.io/ggml-org/llama.cpp:server), so the controller's command line is the same for both;
# /bin/sh, find, sort and head serve its "first .gguf of a directory" command line. Runs as 65532, writes
# nothing outside /tmp. Flavors (one Dockerfile, the flavor is in the base):
#   flexinfer/llamacpp:TAG          CPU backends only
#   flexinfer/llamacpp:TAG-vulkan   + libggml0-backend-vulkan, mesa-vulkan-drivers (AMD radv, Intel anv)
#   flexinfer/llamacpp:TAG-rocm     + libggml0-backend-hip (HIP runtime, hipBLAS, rocBLAS)
# Daemonless, from Debian packages (what scripts/images/build.sh --only llamacpp[-vulkan|-rocm] does; the base
# is the root filesystem of scripts/images/base-llamacpp.sh, which already holds everything):
#   buildah bud -f build/llamacpp.Dockerfile --target runtime-prebuilt \
#     --build-arg BASE=localhost/flexinfer/base:sid-llamacpp-<hash> .
# With a Docker daemon and Debian's public image instead (same packages, plus apt and coreutils):
#   docker build -f build/llamacpp.Dockerfile -t flexinfer/llamacpp .
#   docker build -f build/llamacpp.Dockerfile --build-arg GGML_BACKENDS="libggml0-backend-vulkan=0.27.0-1 mesa-vulkan-drivers" -t flexinfer/llamacpp:vulkan .
#   docker build -f build/llamacpp.Dockerfile --build-arg GGML_BACKENDS=libggml0-backend-hip=0.27.0-1 -t flexinfer/llamacpp:rocm .
ARG BASE=debian:sid-slim

# --- the packages are in the base already ---
FROM ${BASE} AS runtime-prebuilt
ENV HOME=/tmp
USER 65532:65532
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["/app/llama-server"]

# Last stage: the default target.
FROM ${BASE} AS runtime
ARG LLAMACPP_VERSION=1:0.7.0+dfsg-2
ARG GGML_VERSION=0.27.0-1
ARG GGML_BACKENDS=""
# sid's InRelease on some mirrors is past its Valid-Until date. (`set -e` in the command, not SHELL: buildah
# ignores SHELL for OCI-format images.)
RUN set -e; \
    apt-get -o Acquire::Check-Valid-Until=false update; \
    apt-get install -y --no-install-recommends "llama.cpp-tools=${LLAMACPP_VERSION}" \
      "libllama0=${LLAMACPP_VERSION}" "libggml0=${GGML_VERSION}" findutils ca-certificates ${GGML_BACKENDS}; \
    rm -rf /var/lib/apt/lists/*; \
    mkdir -p /app; ln -s /usr/bin/llama-server /app/llama-server; \
    if ! getent group 65532 >/dev/null; then groupadd -g 65532 nonroot; fi; \
    if ! getent passwd 65532 >/dev/null; then \
      useradd -u 65532 -g 65532 -d /home/nonroot -m -s /usr/sbin/nologin nonroot; \
    fi
ENV HOME=/tmp
USER 65532:65532
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["/app/llama-server"]
