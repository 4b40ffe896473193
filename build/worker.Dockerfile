# Worker image: one `flexinfer-worker` binary for download, abliterate, quantize and publish.
# The same binary runs on every base; BASE selects the GPU runtime the (future) GPU backends load at
# run time. Today the engine computes on the CPU (faer) on every base.
#   docker build -f build/worker.Dockerfile -t flexinfer/worker .                                       # CPU
#   docker build -f build/worker.Dockerfile --build-arg BASE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 -t flexinfer/worker:cuda .
#   docker build -f build/worker.Dockerfile --build-arg BASE=rocm/dev-ubuntu-22.04:6.4.1 -t flexinfer/worker:rocm-gfx1100 .
#   docker build -f build/worker.Dockerfile --build-arg BASE=rocm/dev-ubuntu-22.04:6.2.3 -t flexinfer/worker:rocm-gfx906 .
ARG BASE=debian:bookworm-slim
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release -p flexinfer-worker

FROM ${BASE}
RUN (apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*) || true
COPY --from=build /src/target/release/flexinfer-worker /usr/local/bin/flexinfer-worker
RUN useradd -u 10001 -m flexinfer 2>/dev/null || true
USER 10001
ENTRYPOINT ["/usr/local/bin/flexinfer-worker"]
