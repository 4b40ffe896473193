# Worker image: one `flexinfer-worker` binary for download, abliterate, quantize and publish (plus
# `flexinfer-standin`, the OpenAI-compatible stand-in server, where it is built). Runs as 65532, the
# uid/gid the controller's Jobs run their pods as (runAsNonRoot).
# The same binary runs on every base; BASE selects the GPU runtime the GPU sessions load at run time
# (dlopen). scripts/images/build.sh --variant cpu|cuda|rocm-gfx1100|rocm-gfx906 builds the variants from
# Debian packages (scripts/images/variants.sh); the docker lines below are the public-base equivalents.
#   docker build -f build/worker.Dockerfile -t flexinfer/worker .                                       # CPU
#   docker build -f build/worker.Dockerfile --build-arg BASE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 -t flexinfer/worker:cuda .
#   docker build -f build/worker.Dockerfile --build-arg BASE=rocm/dev-ubuntu-22.04:6.4.1 -t flexinfer/worker:rocm-gfx1100 .
#   docker build -f build/worker.Dockerfile --build-arg BASE=rocm/dev-ubuntu-22.04:6.2.3 -t flexinfer/worker:rocm-gfx906 .
# The HIP code objects (gfx1100, gfx906) are embedded in the binary when it is built with
# FLEXINFER_HIP_CODE_OBJECTS naming the output of scripts/hip/build-code-objects.sh (for the full build
# below: a directory inside the build context, by its absolute path in the build stage, e.g.
#   --build-arg FLEXINFER_HIP_CODE_OBJECTS=/src/hip-code-objects
# after copying it to ./hip-code-objects); without it the HIP session needs FLEXINFER_KERNEL_DIR at run time. build.sh's
# ROCm variants check that their binary embeds their target.
# Prebuilt binaries instead of compiling (what scripts/images/build.sh does, daemonless, with the
# base built from Debian packages by scripts/images/base.sh):
#   buildah bud -f build/worker.Dockerfile --target runtime-prebuilt \
#     --build-arg BASE=localhost/flexinfer/base:bookworm-<hash> --build-arg BIN_DIR=<dir in context> .
# runtime-prebuilt runs nothing in BASE (the local base has no shell), so BASE must already provide
# the CA bundle; the full-build runtime installs it and the nonroot user on the Debian/Ubuntu bases.
ARG BASE=debian:bookworm-slim
ARG RUST_IMAGE=rust:1.95-bookworm

# --- binaries from the build context (BIN_DIR: flexinfer-worker, optionally flexinfer-standin) ---
FROM ${BASE} AS runtime-prebuilt
ARG BIN_DIR=target/release
COPY ${BIN_DIR}/flexinfer-worker ${BIN_DIR}/flexinfer-standin* /usr/local/bin/
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/flexinfer-worker"]

# --- full build ---
FROM ${RUST_IMAGE} AS build
# An absolute directory of gptq-<gfx>.hsaco to embed (crates/flexinfer-quant/build.rs); empty: none.
ARG FLEXINFER_HIP_CODE_OBJECTS=""
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p flexinfer-worker \
    && mkdir -p /out \
    && cp target/release/flexinfer-worker /out/ \
    && if [ -e target/release/flexinfer-standin ]; then cp target/release/flexinfer-standin /out/; fi

# Last stage: the default target.
FROM ${BASE} AS runtime
# ca-certificates for HTTPS downloads (Hugging Face, S3); the nonroot user 65532 like distroless.
# Both tolerate bases that already have them. (`set -e` in the command, not SHELL: buildah ignores
# SHELL for OCI-format images.)
RUN set -e; \
    if command -v apt-get >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi; \
    if ! getent group 65532 >/dev/null; then groupadd -g 65532 nonroot; fi; \
    if ! getent passwd 65532 >/dev/null; then \
      useradd -u 65532 -g 65532 -d /home/nonroot -m -s /usr/sbin/nologin nonroot; \
    fi
COPY --from=build /out/ /usr/local/bin/
USER 65532:65532
WORKDIR /home/nonroot
ENTRYPOINT ["/usr/local/bin/flexinfer-worker"]
