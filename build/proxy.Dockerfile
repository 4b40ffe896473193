# Gateway image: `flexinfer-proxy`, the OpenAI-compatible front that routes by model name, scales
# Models from zero and keeps status.lastActiveTime fresh (docs/user/serving.md, "The proxy").
# Runs as 65532; listens on 8000 (API) and 8081 (/healthz, /readyz).
#   docker build -f build/proxy.Dockerfile -t flexinfer/proxy .
# Prebuilt binary (what scripts/images/build.sh does, daemonless, on the Debian-package base):
#   buildah bud -f build/proxy.Dockerfile --target runtime-prebuilt \
#     --build-arg BASE=localhost/flexinfer/base:bookworm-<hash> --build-arg BIN_DIR=<dir in context> .
ARG BASE=debian:bookworm-slim
ARG RUST_IMAGE=rust:1.95-bookworm

# --- binary from the build context ---
FROM ${BASE} AS runtime-prebuilt
ARG BIN_DIR=target/release
COPY ${BIN_DIR}/flexinfer-proxy /usr/local/bin/flexinfer-proxy
USER 65532:65532
EXPOSE 8000 8081
ENTRYPOINT ["/usr/local/bin/flexinfer-proxy"]

# --- full build ---
FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p flexinfer-proxy --bin flexinfer-proxy \
    && mkdir -p /out && cp target/release/flexinfer-proxy /out/

# Last stage: the default target.
FROM ${BASE} AS runtime
SHELL ["/bin/sh", "-ec"]
RUN if ! getent group 65532 >/dev/null; then groupadd -g 65532 nonroot; fi; \
    if ! getent passwd 65532 >/dev/null; then \
      useradd -u 65532 -g 65532 -d /home/nonroot -m -s /usr/sbin/nologin nonroot; \
    fi
COPY --from=build /out/flexinfer-proxy /usr/local/bin/flexinfer-proxy
USER 65532:65532
WORKDIR /home/nonroot
EXPOSE 8000 8081
ENTRYPOINT ["/usr/local/bin/flexinfer-proxy"]
