#!/usr/bin/env bash
# Wide-body load (a benchmark, not a test): the proxy binary receives N (8) bodies of 8 MB
# `{"model":[0,0,…]}` at once and must answer each 400 (or 413/429) and stay up; prints the answers and the
# proxy's resident memory (VmRSS idle, VmHWM peak). No cluster is needed: the proxy's kubeconfig points at a closed
# port, so it routes nothing, but a body is read and its model peeked before routing.
# Usage: scripts/bench/proxy/wide_bodies.sh   (env: N, PROXY_BIN — e.g. a build of an earlier commit, to compare)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd); cd "$ROOT"
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
if [ -z "${PROXY_BIN:-}" ]; then
  cargo build -q -j1 -p flexinfer-proxy --bin flexinfer-proxy
  PROXY_BIN=$TARGET/debug/flexinfer-proxy
fi
N=${N:-8}
W=$(mktemp -d)
PID=
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; rm -rf "$W"' EXIT
cat > "$W/kubeconfig" <<'KC'
apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "http://127.0.0.1:9"}}]
contexts: [{name: none, context: {cluster: none, user: none}}]
current-context: none
users: [{name: none, user: {}}]
KC
python3 - "$W/body" <<'PY'
import sys
body = b'{"model":[' + b'0,' * 3_999_994 + b'0]}'
open(sys.argv[1], 'wb').write(body)
print(f"body: {len(body)} bytes")
PY
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PORT=$(free_port); HPORT=$(free_port)
KUBECONFIG=$W/kubeconfig FLEXINFER_PROXY_LISTEN_ADDR=127.0.0.1:$PORT FLEXINFER_PROXY_HEALTH_ADDR=127.0.0.1:$HPORT \
  RUST_LOG=error "$PROXY_BIN" --log-text > "$W/proxy.log" 2>&1 &
PID=$!
for _ in $(seq 100); do curl -fs "http://127.0.0.1:$HPORT/healthz" > /dev/null && break; sleep 0.1; done
echo "proxy: $PROXY_BIN (pid $PID); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "idle: $(grep VmRSS /proc/$PID/status)"
for i in $(seq "$N"); do
  curl -s -o /dev/null -w '%{http_code}\n' -H 'content-type: application/json' --data-binary "@$W/body" \
    "http://127.0.0.1:$PORT/v1/chat/completions" > "$W/status.$i" &
done
wait $(jobs -p | grep -v "^$PID$") 2>/dev/null || true
echo "answers: $(cat "$W"/status.* | sort | uniq -c | tr -s ' \n' ' ')"
if kill -0 "$PID" 2>/dev/null; then
  echo "proxy alive; $(grep VmHWM /proc/$PID/status) (peak), $(grep VmRSS /proc/$PID/status) (now)"
else
  echo "proxy DIED"; tail -5 "$W/proxy.log"; exit 1
fi
