#!/usr/bin/env bash
# Download/publish throughput of flexinfer-worker vs huggingface_hub (+hf_transfer) and oras,
# side by side on loopback. Not a test. Peers go into a cache venv, never into the repo.
#   scripts/bench/transfer/run.sh            # release build of the worker and the hub (default)
#   WORKER=target/debug/flexinfer-worker scripts/bench/transfer/run.sh   # the hub beside it (or HUB=…)
# Needs /usr/bin/docker-registry (apt-get install -y docker-registry).
set -euo pipefail
cd "$(dirname "$0")/../../.."
VENV="${FLEXINFER_BENCH_VENV:-$HOME/.cache/flexinfer-bench-venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q "huggingface_hub==0.36.0" "hf_transfer==0.1.9" "oras==0.2.43"
if [ -z "${WORKER:-}" ]; then
  cargo build --release -p flexinfer-worker -p flexinfer-hub
  WORKER="$PWD/target/release/flexinfer-worker"
fi
HUB=${HUB:-$(dirname "$WORKER")/flexinfer-hub}
test -x "$HUB" || { echo "no flexinfer-hub at $HUB (cargo build -p flexinfer-hub, or set HUB)" >&2; exit 2; }
test -x /usr/bin/docker-registry || { echo "install docker-registry (apt-get install -y docker-registry)" >&2; exit 2; }
WORKER="$(realpath "$WORKER")" HUB="$(realpath "$HUB")" exec "$VENV/bin/python" scripts/bench/transfer/bench.py
