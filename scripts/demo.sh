#!/usr/bin/env bash
# The main job on a fresh machine: build/start a local control plane (kube-apiserver, etcd,
# controller-manager, scheduler, kwok GPU nodes), install the FlexInfer CRDs, run the controller,
# apply the example GPUProfiles and the Gemma 4 ModelCache (download -> abliterate -> quantize on a
# gfx1100 node), and watch it walk its phases to Ready. Job pods are simulated by kwok (each phase's
# pod runs a few seconds, then succeeds) until real worker images are deployed.
# KEEP=1 leaves the control plane and controller running (prints KUBECONFIG). DEMO_TIMEOUT bounds the wait.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
export TESTENV_BIN=${TESTENV_BIN:-$HOME/.cache/testenv/v1.34.4/bin}
export PATH="$TESTENV_BIN:$PATH"
TIMEOUT=${DEMO_TIMEOUT:-180}
NS=flexinfer-system
CACHE=gemma4-26b-a4b-gptq
bash scripts/install-deps.sh
cargo build -q -j2 -p flexinfer-controller
ENVF=$(mktemp); bash scripts/testenv/up.sh cluster > "$ENVF"; source "$ENVF"
WORK=$(mktemp -d)
CTRL_PID=""
cleanup() {
  [ -n "$CTRL_PID" ] && kill "$CTRL_PID" 2>/dev/null || true
  kubectl delete pv "demo-$CACHE" --wait=false >/dev/null 2>&1 || true
  bash scripts/testenv/down.sh "$TESTENV_DIR" >/dev/null 2>&1 || true
  rm -rf "$ENVF" "$WORK"
}
[ "${KEEP:-0}" = 1 ] || trap cleanup EXIT

echo "==> CRDs"
kubectl apply --server-side -k deploy/crds/ >/dev/null
kubectl wait --for=condition=Established crd/modelcaches.ai.flexinfer crd/models.ai.flexinfer crd/gpuprofiles.ai.flexinfer --timeout=60s
kubectl get nodes -L flexinfer.ai/gpu.arch

echo "==> controller (logs: $WORK/controller.log)"
FLEXINFER_WORKER_IMAGE=registry.example.com/flexinfer/worker:cpu \
FLEXINFER_LEADER_ELECT=true FLEXINFER_NAMESPACE=$NS \
FLEXINFER_METRICS_ADDR=127.0.0.1:18080 FLEXINFER_HEALTH_ADDR=127.0.0.1:18081 \
  ./target/debug/flexinfer-controller > "$WORK/controller.log" 2>&1 &
CTRL_PID=$!

echo "==> GPUProfiles and the example ModelCache"
kubectl apply -f deploy/examples/00-namespace.yaml >/dev/null
kubectl apply -f deploy/examples/gpuprofile-gfx1100.yaml -f deploy/examples/gpuprofile-gfx906.yaml -f deploy/examples/gpuprofile-sm89.yaml
# Nothing provisions volumes in the local cluster: a PV pre-bound to the cache's PVC stands in.
kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolume
metadata: {name: demo-$CACHE}
spec:
  capacity: {storage: 200Gi}
  accessModes: [ReadWriteOnce]
  storageClassName: ""
  hostPath: {path: /tmp/flexinfer-demo}
  claimRef: {namespace: $NS, name: $CACHE-cache}
YAML
# Make the simulated quantize pod take a few seconds so the phases are visible.
sed "/^  name: $CACHE/a\\
  annotations:\\
    flexinfer.ai/job-pod-annotations: '{\"sim.kwok.test/duration\":\"3s\"}'" \
  deploy/examples/modelcache-$CACHE.yaml | kubectl apply -f -

echo "==> watching $NS/$CACHE (timeout ${TIMEOUT}s)"
kubectl get modelcache -n "$NS" "$CACHE" -w &
WATCH=$!
if kubectl wait -n "$NS" "modelcache/$CACHE" --for=jsonpath='{.status.phase}'=Ready --timeout="${TIMEOUT}s" >/dev/null; then
  RESULT=0
else
  RESULT=1
fi
sleep 1; kill "$WATCH" 2>/dev/null || true; wait "$WATCH" 2>/dev/null || true
echo
kubectl get jobs -n "$NS" -l "flexinfer.ai/cache=$CACHE"
kubectl get modelcache -n "$NS" "$CACHE" -o wide
kubectl get events -n "$NS" --field-selector "involvedObject.name=$CACHE" --sort-by=.metadata.creationTimestamp \
  -o custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message | tail -15
if [ "$RESULT" = 0 ]; then
  echo "==> $CACHE is Ready at $(kubectl get modelcache -n "$NS" "$CACHE" -o jsonpath='{.status.path}')"
else
  echo "==> $CACHE did not reach Ready in ${TIMEOUT}s; controller log tail:" >&2
  tail -20 "$WORK/controller.log" >&2
fi
if [ "${KEEP:-0}" = 1 ]; then
  echo "control plane and controller (pid $CTRL_PID) left running: $(cat "$ENVF")"
fi
exit "$RESULT"
