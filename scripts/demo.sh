#!/usr/bin/env bash
# The main job on a fresh machine, for real:
#  - a local cluster (kube-apiserver, etcd, controller-manager, scheduler, kwok GPU nodes) with ONE REAL NODE
#    (kubelet + containerd + runc), a local OCI registry and a local Hugging Face-compatible hub;
#  - the controller and worker images built from build/*.Dockerfile (daemonless, Debian base), FlexInfer
#    installed with its Helm chart (the controller runs as a pod on the real node);
#  - a ModelCache that downloads a small generated Llama model from the hub, abliterates it, GPTQ-quantizes it
#    (int4, group 32: the model is 32 wide) and publishes it to the registry, each phase a Job whose pod runs
#    the real worker image on the real node (the engine computes on the CPU there and says so);
#  - a gated Model that serves the artifact with the OpenAI-compatible stand-in (there is no vLLM here), its
#    PromotionGate decision, the promotion, and one completion request;
#  - GGUF, the default format: a second ModelCache writes one llama.cpp file (Q4_K_M) of the same model and
#    publishes it, and a Model with backend llamacpp serves it with the REAL llama-server (Debian's llama.cpp,
#    the chart's default llama.cpp image), answering a chat completion through flexinfer-proxy.
# KEEP=1 leaves everything running and prints the KUBECONFIG. DEMO_TIMEOUT bounds each wait (seconds).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
export TESTENV_BIN=${TESTENV_BIN:-$HOME/.cache/testenv/v1.34.4/bin}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/flexinfer/target}
export PATH="$TESTENV_BIN:$PATH"
TIMEOUT=${DEMO_TIMEOUT:-900}
NS=flexinfer-demo
CACHE=tiny-llama-gptq
T0=$(date +%s)
say() { echo; echo "==> $* ($(( $(date +%s) - T0 ))s)"; }
# The storage of ModelCache $1 in $NS: a hostPath PersistentVolume on directory $2 and the claim $1 bound to
# it, as YAML documents each followed by ---.
storage_yaml() {
  cat <<YAML
apiVersion: v1
kind: PersistentVolume
metadata: {name: demo-$1}
spec:
  capacity: {storage: 10Gi}
  accessModes: [ReadWriteOnce]
  storageClassName: ""
  hostPath: {path: $2, type: Directory}
  claimRef: {namespace: $NS, name: $1}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: $1, namespace: $NS}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: ""
  volumeName: demo-$1
  resources: {requests: {storage: 10Gi}}
---
YAML
}

say "dependencies (Debian packages, control-plane binaries: cached after the first run)"
bash scripts/install-deps.sh

say "local cluster with a real node"
ENVF=$(mktemp); bash scripts/testenv/up.sh cluster > "$ENVF"; source "$ENVF"
cleanup() { bash scripts/testenv/down.sh "$TESTENV_DIR" >/dev/null 2>&1 || true; rm -f "$ENVF" "${E2EF:-}"; }
[ "${KEEP:-0}" = 1 ] || trap cleanup EXIT
kubectl get nodes -L flexinfer.ai/gpu.arch,flexinfer.ai/testenv-node

say "images, hub, Helm install"
kubectl apply --server-side -k deploy/crds/ >/dev/null
E2EF=$(mktemp); E2E_NAMESPACE=$NS bash scripts/e2e/setup.sh > "$E2EF"; source "$E2EF"
kubectl get pods -n "$E2E_CONTROLLER_NAMESPACE" -o wide

say "storage, GPUProfile and the ModelCache"
DATA=$E2E_STORAGE/$CACHE; mkdir -p "$DATA"; chown 65532:65532 "$DATA"
PLACE='nodeSelector: {flexinfer.ai/gpu.arch: gfx1100, flexinfer.ai/testenv-node: real}
  tolerations: [{key: flexinfer.ai/testenv-node, operator: Equal, value: real, effect: NoSchedule}]'
{ storage_yaml "$CACHE" "$DATA"; cat <<YAML
# The real node stands in for a gfx1100 card: it advertises amd.com/gpu, the worker runs on the CPU backend.
apiVersion: ai.flexinfer/v1alpha2
kind: GPUProfile
metadata: {name: gfx1100, namespace: $NS}
spec:
  architecture: gfx1100
  vendor: amd
  vramMB: 24576
  resourceName: amd.com/gpu
  gpuDriverMemoryMB: 0
  nodeSelector: {flexinfer.ai/gpu.arch: gfx1100, flexinfer.ai/testenv-node: real}
  quantization: {images: {GPTQ: $E2E_WORKER_IMAGE}}
  runtime: {images: {vllm: $E2E_STANDIN_IMAGE}}
---
apiVersion: ai.flexinfer/v1alpha1
kind: ModelCache
metadata: {name: $CACHE, namespace: $NS}
spec:
  source: flexinfer-demo/tiny-llama          # served by the local hub (HF_ENDPOINT)
  existingClaimName: $CACHE
  modelPath: tiny-llama
  $PLACE
  download: {maxMemoryGB: 1}
  abliteration:
    refusalDataset: flexinfer-demo/refusal
    harmlessDataset: flexinfer-demo/harmless
    numSamples: 32
    useGPU: true
    maxMemoryGB: 2
  quantization:
    format: GPTQ
    bits: 4
    groupSize: 32
    useGPU: true
    maxMemoryGB: 2
    calibration: {dataset: flexinfer-demo/calibration, maxSamples: 16, maxSeqLen: 128}
  publish:
    targets: [oci]
    ociRef: $TESTENV_REGISTRY/demo/$CACHE:v1
    insecure: true
YAML
} | kubectl apply -f -

say "watching $NS/$CACHE (kubectl get modelcache -w)"
kubectl get modelcache -n "$NS" "$CACHE" -w &
WATCH=$!
RESULT=0
kubectl wait -n "$NS" "modelcache/$CACHE" --for=jsonpath='{.status.phase}'=Ready --timeout="${TIMEOUT}s" >/dev/null || RESULT=1
sleep 1; kill "$WATCH" 2>/dev/null || true; wait "$WATCH" 2>/dev/null || true
echo
kubectl get pods -n "$NS" -l "flexinfer.ai/cache=$CACHE" -o custom-columns=POD:.metadata.name,PHASE:.metadata.labels.flexinfer\\.ai/phase,NODE:.spec.nodeName,IMAGE:.spec.containers[0].image,STATUS:.status.phase
if [ "$RESULT" != 0 ]; then
  echo "==> $CACHE did not reach Ready in ${TIMEOUT}s" >&2
  kubectl get modelcache -n "$NS" "$CACHE" -o yaml | sed -n '/^status:/,$p' >&2
  kubectl logs -n "$E2E_CONTROLLER_NAMESPACE" -l app.kubernetes.io/component=controller --tail=30 >&2 || true
  exit 1
fi

say "the artifact"
"$E2E_CLI" -n "$NS" quantize status "$CACHE"
ART=$DATA/$(kubectl get modelcache -n "$NS" "$CACHE" -o jsonpath='{.status.path}' | sed 's#^[^:]*:##')   # status.path is <claim>:<path>
echo "status.path on the node: $ART"; ls -la "$ART"
echo "quality sidecar:"; cat "$ART/.quantization-quality.json"; echo
echo "published: $(kubectl get modelcache -n "$NS" "$CACHE" -o jsonpath='{.status.publish.ociDigest}') at $TESTENV_REGISTRY/demo/$CACHE:v1"
"$E2E_CLI" quantize validate-artifact --path "$ART"

say "a gated canary Model for the artifact"
kubectl apply -f - <<YAML
apiVersion: ai.flexinfer/v1alpha2
kind: Model
metadata:
  name: $CACHE
  namespace: $NS
  annotations: {flexinfer.ai/promotion-gate: quantized-artifact-v1}
spec:
  backend: vllm
  source: modelcache://$CACHE
  gpu: {count: 1, profile: gfx1100}
  serverless: {enabled: true, minReplicas: 0}
  config: {warmPolicy: ondemand}
  resources: {requests: {memory: 256Mi}, limits: {memory: 1Gi}}
  $PLACE
YAML
sleep 3
kubectl get model -n "$NS" "$CACHE" -o jsonpath='{range .status.conditions[?(@.type=="PromotionGate")]}PromotionGate={.status} {.reason}: {.message}{"\n"}{end}'
cat <<EOF
To promote it to warm-primary service (after validating it; see docs/user/promotion-gate.md):
  kubectl annotate model -n $NS $CACHE flexinfer.ai/promotion-validation=passed
  kubectl patch model -n $NS $CACHE --type merge -p '{"spec":{"serverless":{"minReplicas":1},"config":{"warmPolicy":"primary"}}}'
The demo does that now.
EOF
kubectl annotate model -n "$NS" "$CACHE" flexinfer.ai/promotion-validation=passed --overwrite >/dev/null
kubectl patch model -n "$NS" "$CACHE" --type merge -p '{"spec":{"serverless":{"minReplicas":1},"config":{"warmPolicy":"primary"}}}' >/dev/null
kubectl rollout status -n "$NS" "deploy/$CACHE" --timeout=180s
kubectl get model -n "$NS" "$CACHE" -o wide
IP=$(kubectl get pods -n "$NS" -l "flexinfer.ai/model=$CACHE" -o jsonpath='{.items[0].status.podIP}')
echo "served by the stand-in backend (flexinfer-standin: the engine's reader + greedy CPU decoding; NOT vLLM):"
curl -sf "http://$IP:8000/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\":\"$CACHE\",\"prompt\":\"hello world\",\"max_tokens\":8}"; echo

say "GGUF (the default format): a ModelCache writing one llama.cpp file, served by the real llama-server"
GCACHE=tiny-llama-gguf
GDATA=$E2E_STORAGE/$GCACHE; mkdir -p "$GDATA"; chown 65532:65532 "$GDATA"
{ storage_yaml "$GCACHE" "$GDATA"; cat <<YAML
apiVersion: ai.flexinfer/v1alpha1
kind: ModelCache
metadata: {name: $GCACHE, namespace: $NS}
spec:
  source: flexinfer-demo/tiny-llama-bpe   # a tokenizer llama.cpp knows (byte-level BPE)
  existingClaimName: $GCACHE
  modelPath: tiny-llama-bpe
  $PLACE
  download: {maxMemoryGB: 1}
  quantization:
    format: GGUF          # ggufType Q4_K_M when unset; the GGUF engine runs on the CPU
    maxMemoryGB: 2
  publish:
    targets: [oci]
    ociRef: $TESTENV_REGISTRY/demo/$GCACHE:v1
    insecure: true
YAML
} | kubectl apply -f -
kubectl wait -n "$NS" "modelcache/$GCACHE" --for=jsonpath='{.status.phase}'=Ready --timeout="${TIMEOUT}s" >/dev/null || {
  kubectl get modelcache -n "$NS" "$GCACHE" -o yaml | sed -n '/^status:/,$p' >&2; exit 1; }
"$E2E_CLI" -n "$NS" quantize status "$GCACHE"
GART=$GDATA/$(kubectl get modelcache -n "$NS" "$GCACHE" -o jsonpath='{.status.path}' | sed 's#^[^:]*:##')
ls -la "$GART"
echo "The real node stands in for ONE GPU: the GPTQ Model gives it back before the llama.cpp Model starts."
kubectl delete model -n "$NS" "$CACHE" --wait=true >/dev/null
kubectl wait -n "$NS" --for=delete pod -l "flexinfer.ai/model=$CACHE" --timeout=120s >/dev/null 2>&1 || true
kubectl apply -f - <<YAML
apiVersion: ai.flexinfer/v1alpha2
kind: Model
metadata: {name: $GCACHE, namespace: $NS}
spec:
  backend: llamacpp                 # image: the chart's runtime.images.llamacpp
  source: modelcache://$GCACHE
  gpu: {count: 1, profile: gfx1100}
  serverless: {enabled: false}
  config: {maxModelLen: 512}
  resources: {requests: {memory: 256Mi}, limits: {memory: 1Gi}}
  $PLACE
YAML
sleep 3
kubectl rollout status -n "$NS" "deploy/$GCACHE" --timeout=240s
kubectl get pods -n "$NS" -l "flexinfer.ai/model=$GCACHE" -o custom-columns=POD:.metadata.name,NODE:.spec.nodeName,IMAGE:.spec.containers[0].image,STATUS:.status.phase
PROXY=$(kubectl get pods -n "$E2E_CONTROLLER_NAMESPACE" -l "$E2E_PROXY_SELECTOR" -o jsonpath='{.items[0].status.podIP}')
echo "served by the REAL llama-server (Debian llama.cpp; system_fingerprint names its build), through flexinfer-proxy at $PROXY"
echo "(the model's weights are random, so the text is noise; the demo shows the path, not quality):"
for _ in $(seq 1 30); do
  curl -sf "http://$PROXY:8000/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\":\"$GCACHE\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hello.\"}],\"max_tokens\":8,\"ignore_eos\":true}" \
    && break
  sleep 2
done; echo

say "done"
if [ "${KEEP:-0}" = 1 ]; then
  echo "KEEP=1: cluster left running."; cat "$ENVF" "$E2EF"
  echo "stop it with: bash scripts/testenv/down.sh $TESTENV_DIR"
fi
