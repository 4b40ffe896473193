# Serving stand-in image: `flexinfer-standin`, a small OpenAI-compatible server that loads a FlexInfer
# artifact with the engine's reader (docs/user/serving.md), for clusters that cannot run vLLM (the local
# test cluster, `make demo`). The binary is also installed as /usr/local/bin/python3, so the Model
# controller's vLLM command line (`python3 -m vllm.entrypoints.openai.api_server --model … --port 8000`)
# starts it unchanged. Runs as 65532.
#   docker build -f build/standin.Dockerfile -t flexinfer/standin .
# Prebuilt binary (what scripts/images/build.sh does, daemonless, on the Debian-package base):
#   buildah bud -f build/standin.Dockerfile --target runtime-prebuilt \
#     --build-arg BASE=localhost/flexinfer/base:bookworm-<hash> --build-arg BIN_DIR=<dir in context> .
ARG BASE=debian:bookworm-slim
ARG RUST_IMAGE=rust:1.95-bookworm

# --- binary from the build context ---
FROM ${BASE} AS runtime-prebuilt
ARG BIN_DIR=target/release
COPY ${BIN_DIR}/flexinfer-standin /usr/local/bin/flexinfer-standin
COPY ${BIN_DIR}/flexinfer-standin /usr/local/bin/python3
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/flexinfer-standin"]

# --- full build ---
FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p flexinfer-worker --bin flexinfer-standin \
    && mkdir -p /out && cp target/release/flexinfer-standin /out/

# Last stage: the default target.
FROM ${BASE} AS runtime
SHELL ["/bin/sh", "-ec"]
RUN if ! getent group 65532 >/dev/null; then groupadd -g 65532 nonroot; fi; \
    if ! getent passwd 65532 >/dev/null; then \
      useradd -u 65532 -g 65532 -d /home/nonroot -m -s /usr/sbin/nologin nonroot; \
    fi
COPY --from=build /out/flexinfer-standin /usr/local/bin/flexinfer-standin
RUN ln -s flexinfer-standin /usr/local/bin/python3
USER 65532:65532
WORKDIR /home/nonroot
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/flexinfer-standin"]
