# Controller image: the controller and the `flexinfer` CLI on a distroless-style base, non-root (65532).
#
# Full build from the repository root (compiles in the rust stage; BuildKit builds only the stages
# the target needs):
#   docker build -f build/controller.Dockerfile -t flexinfer/controller .
# Prebuilt binaries instead of compiling (what scripts/images/build.sh does, daemonless, with the
# base built from Debian packages by scripts/images/base.sh):
#   buildah bud -f build/controller.Dockerfile --target runtime-prebuilt \
#     --build-arg BASE=localhost/flexinfer/base:bookworm-<hash> --build-arg BIN_DIR=<dir in context> .
# BASE must already provide the CA bundle and the nonroot user (distroless :nonroot and the local
# base both do); the runtime stages run nothing in it (there is no shell).
ARG BASE=gcr.io/distroless/cc-debian12:nonroot
ARG RUST_IMAGE=rust:1.95-bookworm

# --- binaries from the build context (BIN_DIR: flexinfer-controller and flexinfer) ---
FROM ${BASE} AS runtime-prebuilt
ARG BIN_DIR=target/release
COPY ${BIN_DIR}/flexinfer-controller ${BIN_DIR}/flexinfer /usr/local/bin/
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/flexinfer-controller"]

# --- full build ---
FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p flexinfer-controller -p flexinfer-cli

# Last stage: the default target.
FROM ${BASE} AS runtime
COPY --from=build /src/target/release/flexinfer-controller /src/target/release/flexinfer /usr/local/bin/
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/flexinfer-controller"]
