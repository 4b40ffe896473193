#!/usr/bin/env bash
# Proxy benchmark (not a test): flexinfer-proxy in front of an in-process OpenAI-style backend,
# measured side by side with the same requests sent straight to the backend: added latency p50/p99, throughput of
# 500 concurrent SSE streams, the proxy's CPU time and RSS. A local control plane (api mode) is started and torn
# down. Usage: scripts/bench/proxy/run.sh   (env: LAT_N, STREAMS, EVENTS, ROUNDS, PACE_MS, PROXY_BIN; see
# examples/bench.rs), BENCH_CPUS (shared | split)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd); cd "$ROOT"
export TESTENV_BIN=${TESTENV_BIN:-$HOME/.cache/testenv/v1.34.4/bin}
export PATH="$TESTENV_BIN:$PATH"
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
# BENCH_PROFILE=release (default) or dev (dependencies at opt-level 2, the proxy crate itself unoptimised).
PROFILE=${BENCH_PROFILE:-release}
if [ "$PROFILE" = release ]; then
  cargo build -q --release -j2 -p flexinfer-proxy --bin flexinfer-proxy --example bench; OUT=$TARGET/release
else
  cargo build -q -j2 -p flexinfer-proxy --bin flexinfer-proxy --example bench; OUT=$TARGET/debug
fi
ulimit -n 65536 2>/dev/null || ulimit -n 8192
W=$(mktemp -d)
TESTENV_REAL_NODE=0 bash scripts/testenv/up.sh api > "$W/env"; source "$W/env"
trap 'bash scripts/testenv/down.sh "$TESTENV_DIR" >/dev/null 2>&1 || true; rm -rf "$W"' EXIT
kubectl apply --server-side -k deploy/crds/ >/dev/null
kubectl wait --for=condition=Established crd/models.ai.flexinfer --timeout=60s >/dev/null
# A non-loopback address of this host (EndpointSlices refuse loopback).
IP=$(python3 -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(("10.255.255.254", 9)); print(s.getsockname()[0])')
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) CPUs"
echo "profile: $PROFILE"
# PROXY_BIN overrides the proxy binary (e.g. a build of another commit, for a before/after comparison).
PROXY_BIN="${PROXY_BIN:-$OUT/flexinfer-proxy}"
# BENCH_CPUS=split: the bench process (client and backend) on CPU 0 and the proxy alone on CPU 1, so "direct" and
# "via proxy" give the client and backend the same one CPU and the ratio measures the proxy's own cost (as when
# the proxy pods have CPU of their own), not the proxy taking CPU from the backend. Default: shared (no pinning).
CPUS=${BENCH_CPUS:-shared}
echo "cpus: $CPUS"
BENCH=("$OUT/examples/bench")
if [ "$CPUS" = split ]; then
  [ "$(nproc)" -ge 2 ] || { echo "BENCH_CPUS=split needs 2 CPUs" >&2; exit 2; }
  printf '#!/bin/sh\nexec taskset -c 1 %q "$@"\n' "$PROXY_BIN" > "$W/proxy-on-cpu1"; chmod +x "$W/proxy-on-cpu1"
  PROXY_BIN=$W/proxy-on-cpu1; BENCH=(taskset -c 0 "$OUT/examples/bench")
elif [ "$CPUS" != shared ]; then
  echo "BENCH_CPUS must be shared or split, not '$CPUS'" >&2; exit 2
fi
PROXY_BIN="$PROXY_BIN" BENCH_HOST_IP="$IP" "${BENCH[@]}"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
