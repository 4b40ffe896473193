#!/usr/bin/env bash
# The main job on a fresh machine: build/start a local control plane (kube-apiserver, etcd,
# controller-manager, scheduler, kwok GPU nodes), install the FlexInfer CRDs, apply the examples
# and list them. Set KEEP=1 to leave the control plane running (it prints the KUBECONFIG).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
export TESTENV_BIN=${TESTENV_BIN:-$HOME/.cache/testenv/v1.34.4/bin}
export PATH="$TESTENV_BIN:$PATH"
bash scripts/install-deps.sh
ENVF=$(mktemp); bash scripts/testenv/up.sh cluster > "$ENVF"; source "$ENVF"
[ "${KEEP:-0}" = 1 ] || trap 'bash scripts/testenv/down.sh "$TESTENV_DIR" >/dev/null; rm -f "$ENVF"' EXIT
kubectl apply --server-side -k deploy/crds/
kubectl wait --for=condition=Established crd/modelcaches.ai.flexinfer crd/models.ai.flexinfer crd/gpuprofiles.ai.flexinfer --timeout=60s
kubectl apply -f deploy/examples/
kubectl get nodes -L flexinfer.ai/gpu.arch
kubectl get modelcaches,models,gpuprofiles -A
[ "${KEEP:-0}" = 1 ] && echo "control plane left running: $(cat "$ENVF")"
