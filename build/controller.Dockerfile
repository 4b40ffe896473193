# Controller image: a static-ish Rust binary on a distroless base, non-root.
# Build from the repository root:  docker build -f build/controller.Dockerfile -t flexinfer/controller .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release -p flexinfer-controller -p flexinfer-cli

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/flexinfer-controller /usr/local/bin/flexinfer-controller
COPY --from=build /src/target/release/flexinfer /usr/local/bin/flexinfer
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/flexinfer-controller"]
