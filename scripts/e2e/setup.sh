#!/usr/bin/env bash
# Prepare a running local cluster (scripts/testenv/up.sh cluster, with its real node) for the real pipeline,
# the way a user's cluster would be: images built and pushed, FlexInfer installed with its Helm chart.
#  1. builds the binaries (cargo, incremental) and the images (scripts/images/build.sh), pushes them to the
#     testenv registry and loads them into the node's containerd;
#  2. writes the local hub's repositories (the hub_fixtures example) and starts flexinfer-hub
#     (crates/flexinfer-hub) on the node's bridge address, so pods download from it;
#  3. `helm upgrade --install`s charts/flexinfer with the controller pinned to the real node; the post-renderer
#     scripts/e2e/post-render.py adapts only what this cluster lacks (kube-proxy, token volume injection).
# usage (after `source` of up.sh's output):  scripts/e2e/setup.sh > env; source env
# Prints one `export E2E_…=…` line (E2E_LLAMACPP_IMAGE: the llama.cpp serving image, Debian sid's llama-server).
# Env: E2E_WATCH_NAMESPACE (default: all namespaces), E2E_NAMESPACE (created and labelled for the
# promotion-gate policy; default flexinfer-e2e), E2E_TAG (default e2e).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
for v in KUBECONFIG TESTENV_DIR TESTENV_NODE TESTENV_HOST_IP TESTENV_REGISTRY TESTENV_CONTAINERD_ADDRESS; do
  [ -n "${!v:-}" ] || { echo "e2e-setup: $v is not set: start the cluster with scripts/testenv/up.sh cluster (real node) and source its output" >&2; exit 1; }
done
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
TAG=${E2E_TAG:-e2e}
CNS=${E2E_CONTROLLER_NAMESPACE:-flexinfer-system}
NS=${E2E_NAMESPACE:-flexinfer-e2e}
REG=$TESTENV_REGISTRY
t0=$(date +%s)
log() { echo "e2e-setup: $* ($(( $(date +%s) - t0 )) s)" >&2; }
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

log "binaries"
# The same build as `make test`'s (bins, flexinfer-hub among them, and examples included): with the test
# profile's feature set, so nothing is compiled twice; a no-op when the tests are built.
cargo test -q -j2 --workspace --no-run >&2

log "images"
# build.sh's default set includes flexinfer/llamacpp (Debian's llama-server, CPU): E2E_LLAMACPP_IMAGE below.
bash scripts/images/build.sh --bin-dir "$TARGET/debug" --tag "$TAG" --push "$REG" --load >&2

log "hub repositories and server"
HUB=$TESTENV_DIR/hub
rm -rf "$HUB"; mkdir -p "$HUB"
"$TARGET/debug/examples/hub_fixtures" "$HUB/repos" >/dev/null
nohup "$TARGET/debug/flexinfer-hub" --root "$HUB/repos" --host "$TESTENV_HOST_IP" --port 0 \
  --ready-file "$HUB/port" > "$TESTENV_DIR/logs/hub.log" 2>&1 &
echo "$! hub-server" >> "$TESTENV_DIR/pids"      # down.sh stops it with the rest
for _ in $(seq 1 100); do [ -s "$HUB/port" ] && break; sleep 0.1; done
[ -s "$HUB/port" ] || { echo "e2e-setup: hub server did not start (log: $TESTENV_DIR/logs/hub.log)" >&2; exit 1; }
HF=http://$TESTENV_HOST_IP:$(cat "$HUB/port")
curl -sf --max-time 5 "$HF/api/models/flexinfer-demo/tiny-llama" >/dev/null \
  || { echo "e2e-setup: hub at $HF does not answer" >&2; exit 1; }

log "namespaces"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl label namespace "$NS" flexinfer.ai/e2e=true --overwrite >/dev/null

log "helm install (controller on the real node)"
AP=$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}'); AP=${AP##*:}
# The proxy pods use the pod network (two replicas, each with its own IP, as users run it); they reach the
# API server, which listens on the host's loopback only, through a TCP relay on the host's bridge address.
rm -f "$TESTENV_DIR/relay.port"
nohup python3 scripts/e2e/tcp-relay.py "$TESTENV_HOST_IP" "127.0.0.1:$AP" "$TESTENV_DIR/relay.port" \
  > "$TESTENV_DIR/logs/relay.log" 2>&1 &
echo "$! apiserver-relay" >> "$TESTENV_DIR/pids"
for _ in $(seq 1 100); do [ -s "$TESTENV_DIR/relay.port" ] && break; sleep 0.1; done
[ -s "$TESTENV_DIR/relay.port" ] || { echo "e2e-setup: API server relay did not start" >&2; exit 1; }
export E2E_APISERVER_RELAY=$TESTENV_HOST_IP:$(cat "$TESTENV_DIR/relay.port") E2E_RELEASE_NAMESPACE=$CNS
NODE_IP=$(kubectl get node "$TESTENV_NODE" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}')
export E2E_APISERVER_PORT=$AP E2E_LISTEN_HOST=${NODE_IP:-127.0.0.1} E2E_METRICS_PORT=$(free_port) E2E_HEALTH_PORT=$(free_port)
WORKER=$REG/flexinfer/worker:$TAG
# E2E_WATCH_NAMESPACE set: the namespace-scoped install (watchNamespaces), so the real pipeline runs with Roles
# only in that namespace (and the Lease Role in the release namespace) — no ClusterRole.
WATCH_VALUES=""
[ -n "${E2E_WATCH_NAMESPACE:-}" ] && WATCH_VALUES="watchNamespaces: [\"$E2E_WATCH_NAMESPACE\"]"
# --take-ownership: the suite applied the CRDs with kubectl first (and the chart tests' release owned them); this
# release takes them over, as a user's first upgrade from a chart that shipped them in crds/ does.
helm upgrade --install flexinfer charts/flexinfer -n "$CNS" --create-namespace --wait --timeout 5m --take-ownership \
  --post-renderer scripts/e2e/post-render.py -f - >&2 <<VALUES
image: {repository: $REG/flexinfer/controller, tag: "$TAG", pullPolicy: IfNotPresent}
worker: {image: {repository: $REG/flexinfer/worker, tag: "$TAG"}}
quantization:
  gptq: {image: "$WORKER", rocmImage: "$WORKER", archImages: {gfx1100: "$WORKER", gfx906: "$WORKER"}}
# Models with backend llamacpp get the llama.cpp image built above (Debian's llama-server) by default.
runtime: {images: {llamacpp: "$REG/flexinfer/llamacpp:$TAG"}}
workerServiceAccount: {additionalNamespaces: ["$NS"]}
admissionPolicy:
  namespaceSelector: {matchLabels: {flexinfer.ai/e2e: "true"}}
# GPU pods get this group (the real node's 'video' gid on Debian; any gid works for the test).
gpuSupplementalGroups: [44]
# The proxy runs on the real node too: the chart's two replicas, on the pod network.
proxy:
  replicas: 2
  image: {repository: $REG/flexinfer/proxy, tag: "$TAG", pullPolicy: IfNotPresent}
  nodeSelector: {flexinfer.ai/testenv-node: real}
  tolerations: [{key: flexinfer.ai/testenv-node, operator: Equal, value: real, effect: NoSchedule}]
  keepaliveInterval: 2s
controller:
  nodeSelector: {flexinfer.ai/testenv-node: real}
  tolerations: [{key: flexinfer.ai/testenv-node, operator: Equal, value: real, effect: NoSchedule}]
  extraEnv:
    - {name: HF_ENDPOINT, value: "$HF"}
    - {name: FLEXINFER_PROGRESS_POLL_SECONDS, value: "1"}
    - {name: FLEXINFER_RETRY_BASE_SECONDS, value: "5"}
# NodeLocal caches: the controller may label nodes; the copies live under the test environment.
nodeLocal: {enabled: true, hostPath: "$TESTENV_DIR/node-local"}
$WATCH_VALUES
VALUES

mkdir -p "$TESTENV_DIR/storage"
# The chart's alert rules for the real Prometheus of the kill test (its `for` shortened so the alert can
# fire within the test), rendered from the same chart and values path as the PrometheusRule.
helm template flexinfer charts/flexinfer -n "$CNS" --set alerting.enabled=true \
  --set alerting.quantizedOnCPU.for=1s \
  | python3 scripts/chart-tests/extract-rules.py "$TESTENV_DIR/e2e-alert-rules.yaml" >&2
# Its scrape config: what prometheus-operator makes of the chart's controller ServiceMonitor (the metrics
# Service's ready endpoints, the operator's target labels, the endpoint's honorLabels), so the test sees the
# labels a cluster with the operator sees — among them the cache's own `namespace`.
helm template flexinfer charts/flexinfer -n "$CNS" --set serviceMonitor.enabled=true \
  | python3 scripts/e2e/servicemonitor-scrape.py 1s "$TESTENV_DIR/e2e-scrape-config.json" \
      "$TESTENV_DIR/e2e-scrape-targets.json" --discover
log "ready: hub $HF, registry $REG, controller in $CNS"
echo "export E2E_NAMESPACE=$NS E2E_CONTROLLER_NAMESPACE=$CNS E2E_HF_ENDPOINT=$HF E2E_WORKER_IMAGE=$WORKER" \
  "E2E_CONTROLLER_IMAGE=$REG/flexinfer/controller:$TAG E2E_STANDIN_IMAGE=$REG/flexinfer/standin:$TAG" \
  "E2E_LLAMACPP_IMAGE=$REG/flexinfer/llamacpp:$TAG" \
  "E2E_STORAGE=$TESTENV_DIR/storage E2E_CLI=$TARGET/debug/flexinfer" \
  "E2E_PROXY_SELECTOR=app.kubernetes.io/component=proxy E2E_ALERT_RULES=$TESTENV_DIR/e2e-alert-rules.yaml" \
  "E2E_SCRAPE_CONFIG=$TESTENV_DIR/e2e-scrape-config.json E2E_NODE_LOCAL_ROOT=$TESTENV_DIR/node-local"
