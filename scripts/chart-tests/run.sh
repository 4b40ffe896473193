#!/usr/bin/env bash
# Helm chart / kustomize / alert tests for FlexInfer. Run by `make test`.
#   KUBECONFIG=<local test API server> scripts/chart-tests/run.sh
# Static checks need helm, python3 (+PyYAML) and promtool; live checks need KUBECONFIG (scripts/testenv/up.sh api)
# and the generated CRDs in deploy/crds. Without KUBECONFIG the run FAILS (set CHART_TESTS_STATIC_ONLY=1 to run the
# static part alone while developing). Prints `N passed, M failed` last; exits non-zero on any failure.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
HERE=scripts/chart-tests; CHART=charts/flexinfer
BIN=${TESTENV_BIN:-$HOME/.cache/testenv/v1.34.4/bin}
HELM=${HELM:-$(command -v helm || echo "$BIN/helm")}; export HELM
PASS=0; FAIL=0; FAILED=()
T=$(mktemp -d); RUN_ID=$(head -c4 /dev/urandom | od -An -tx1 | tr -d ' \n')
NS=fi-chart-$RUN_ID; REL=fi-$RUN_ID; CREATED_STUBS=0; LIVE=0

pass() { PASS=$((PASS + 1)); echo "ok   $1"; }
fail() { FAIL=$((FAIL + 1)); FAILED+=("$1"); echo "FAIL $1"; [ -n "${2:-}" ] && echo "$2" | tail -25 | sed 's/^/     /'; }
# t NAME CMD...: run CMD, pass when it exits 0
t() { local n=$1 out; shift; if out=$("$@" 2>&1); then pass "$n"; else fail "$n" "$out"; fi; }
# tn NAME CMD...: pass when CMD exits non-zero (a rejection we expect)
tn() { local n=$1 out; shift; if out=$("$@" 2>&1); then fail "$n" "unexpectedly succeeded: $out"; else pass "$n"; fi; }
# ts NAME HELM-ARGS...: pass when helm rejects the values through values.schema.json
ts() { local n=$1 out; shift; if out=$("$HELM" "$@" 2>&1); then fail "$n" "unexpectedly succeeded"; \
  elif grep -q "schema" <<<"$out"; then pass "$n"; else fail "$n" "failed, but not by the schema: $out"; fi; }

cleanup() {
  if [ "$LIVE" = 1 ]; then
    "$HELM" uninstall "$REL" -n "$NS" --wait=false >/dev/null 2>&1
    "$HELM" uninstall "$REL-scoped" -n "$NS-scoped" --wait=false >/dev/null 2>&1
    kubectl delete ns "$NS" "$NS-other" "$NS-scoped" "$NS-watched" --wait=false >/dev/null 2>&1
    kubectl delete validatingadmissionpolicy,validatingadmissionpolicybinding -l "app.kubernetes.io/instance=$REL" >/dev/null 2>&1
    [ "$CREATED_STUBS" = 1 ] && kubectl delete -f "$HERE/fixtures/stub-crds.yaml" --timeout=60s >/dev/null 2>&1
  fi
  rm -rf "$T"
}
trap cleanup EXIT

need() { command -v "$1" >/dev/null 2>&1 || [ -x "$1" ]; }
for tool in "$HELM" python3 promtool kubectl; do
  need "$tool" || { echo "missing tool: $tool (helm: scripts/testenv/build-bins.sh; promtool: apt-get install prometheus)"; echo "0 passed, 1 failed"; exit 1; }
done
python3 -c 'import yaml' 2>/dev/null || pip install --quiet pyyaml >/dev/null 2>&1 || true
python3 -c 'import yaml' 2>/dev/null || { echo "python3 PyYAML missing and pip install failed"; echo "0 passed, 1 failed"; exit 1; }

echo "== static: lint, template, schema"
t "helm lint --strict (defaults)" "$HELM" lint --strict "$CHART"
t "helm lint --strict (all toggles on)" "$HELM" lint --strict "$CHART" -f "$HERE/values-all-on.yaml"
"$HELM" template flexinfer "$CHART" -n flexinfer-system > "$T/default.yaml" 2>"$T/err" \
  && pass "helm template (defaults)" || fail "helm template (defaults)" "$(cat "$T/err")"
"$HELM" template flexinfer "$CHART" -n flexinfer-system -f "$HERE/values-all-on.yaml" > "$T/allon.yaml" 2>"$T/err" \
  && pass "helm template (all toggles on)" || fail "helm template (all toggles on)" "$(cat "$T/err")"
t "rendered defaults: objects, env, security context, RBAC" python3 "$HERE/check_render.py" defaults < "$T/default.yaml"
t "rendered all-on: objects, env, security context, RBAC" python3 "$HERE/check_render.py" allon < "$T/allon.yaml"
ts "schema rejects unknown top-level key" template x "$CHART" --set bogus=1
ts "schema rejects threshold > 1" template x "$CHART" --set alerting.deadlineApproaching.threshold=2
ts "schema rejects bad duration" template x "$CHART" --set alerting.stalled.for=soon
ts "schema rejects unknown quantization format" template x "$CHART" --set quantization.images.int3=x
t "schema accepts registry:port/repo:tag and @sha256 images" "$HELM" template x "$CHART" \
  --set quantization.gptq.archImages.gfx906=registry.lan:5000/fi/quantizer:gptq-rocm-gfx906 \
  --set quantization.images.gguf=registry.lan:5000/fi/quantizer@sha256:$(printf '0%.0s' $(seq 64))
ts "schema rejects an image with whitespace" template x "$CHART" --set 'quantization.images.gptq=bad image'
ts "schema rejects bad validationActions" template x "$CHART" --set 'admissionPolicy.validationActions={Reject}'
ts "schema rejects a credential registry with a scheme" template x "$CHART" --set 'credentialRegistries={https://ghcr.io}'
ts "schema rejects a reserved Model name that no Model may have" template x "$CHART" --set 'admissionPolicy.reservedModelNames.team-a={-bad}'
t "a Model name reserved to two namespaces is refused at render, naming both" bash -c "out=\$('$HELM' template x '$CHART' \
  --set 'admissionPolicy.reservedModelNames.team-a={llama}' --set 'admissionPolicy.reservedModelNames.team-b={llama}' 2>&1) && exit 1; \
  grep -q 'reservedModelNames: \"llama\" is reserved to both team-a and team-b' <<<\"\$out\""
t "reserved Model names render one policy and binding; none by default" bash -c "set -e
  [ \$('$HELM' template x '$CHART' --set 'admissionPolicy.reservedModelNames.team-a={llama}' | grep -c 'name: x-flexinfer-model-names') = 2 ]
  ! '$HELM' template x '$CHART' | grep -q model-names"
t "toggles off: no admission policy, no RBAC" bash -c "out=\$('$HELM' template x '$CHART' --set admissionPolicy.enabled=false --set rbac.create=false) \
  && ! grep -qE 'kind: (ValidatingAdmissionPolicy|ClusterRole|Role)\$' <<<\"\$out\""
t "proxy.enabled=false: no proxy objects" bash -c "out=\$('$HELM' template x '$CHART' --set proxy.enabled=false) \
  && ! grep -q 'app.kubernetes.io/component: proxy' <<<\"\$out\" && grep -q 'component: controller' <<<\"\$out\""
t "ServiceMonitor as prometheus-operator scrapes it (the e2e Prometheus's config): honor_labels, valid for promtool" bash -c "set -e
  '$HELM' template x '$CHART' -n rel --set serviceMonitor.enabled=true | python3 scripts/e2e/servicemonitor-scrape.py 1s '$T/sm.json' '$T/targets.json' 2>/dev/null
  python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); assert c[\"honor_labels\"] is True, c; assert c[\"metrics_path\"]==\"/metrics\", c' '$T/sm.json'
  python3 -c 'import json,sys; print(json.dumps({\"scrape_configs\": [json.load(open(sys.argv[1]))]}))' '$T/sm.json' > '$T/prom.yml'
  promtool check config --syntax-only '$T/prom.yml' >/dev/null"
t "backends PodMonitor: vLLM and llama.cpp serving pods on port http, model label; watched namespaces, else any; off by default" bash -c "set -e
  '$HELM' template x '$CHART' | grep -q 'kind: PodMonitor' && exit 1
  out=\$('$HELM' template x '$CHART' --set serviceMonitor.backends.enabled=true)
  python3 -c 'import sys,yaml; d=[o for o in yaml.safe_load_all(sys.stdin) if o and o[\"kind\"]==\"PodMonitor\"]; assert len(d)==1, d; s=d[0][\"spec\"]; assert s[\"namespaceSelector\"]=={\"any\": True}, s; assert s[\"selector\"][\"matchLabels\"]=={\"app.kubernetes.io/component\": \"inference-server\"}, s; assert s[\"selector\"][\"matchExpressions\"][0][\"values\"]==[\"vllm\",\"llamacpp\"], s; e=s[\"podMetricsEndpoints\"][0]; assert e[\"port\"]==\"http\" and e[\"path\"]==\"/metrics\", e; assert e[\"relabelings\"][0][\"targetLabel\"]==\"model\", e' <<<\"\$out\"
  '$HELM' template x '$CHART' --set serviceMonitor.backends.enabled=true --set 'watchNamespaces={a,b}' | grep -A3 'namespaceSelector' | grep -q -- '- b'
  '$HELM' template x '$CHART' --set serviceMonitor.backends.enabled=true --set 'watchNamespaces={a}' --set 'serviceMonitor.backends.namespaces={c}' | grep -A3 'namespaceSelector' | grep -q -- '- c'"
t "long-context probe (scripts/probe-gemma4-long-context.sh): passes a right server; garbage, repetition, a lost code and no server fail" \
  python3 scripts/probe/test_probe.py
t "chart README is generated from values.yaml (scripts/chart/readme.py)" python3 scripts/chart/readme.py --check
DIG=sha256:$(printf 'ab%.0s' $(seq 32))
t "digests pin the controller, proxy, worker variants and llama.cpp flavors; a variant without one runs by tag" bash -c "set -e
  out=\$('$HELM' template x '$CHART' --set gpuProfiles.enabled=true --set image.digest=$DIG --set proxy.image.digest=$DIG \
    --set worker.image.digests.cpu=$DIG --set worker.image.digests.rocm-gfx906=$DIG --set runtime.llamacpp.digests.rocm=$DIG)
  grep -q 'image: ghcr.io/flexinfer/flexinfer-controller:[^@ ]*@$DIG\$' <<<\"\$out\"
  grep -q 'image: ghcr.io/flexinfer/flexinfer-proxy:[^@ ]*@$DIG\$' <<<\"\$out\"
  grep -A1 'name: FLEXINFER_WORKER_IMAGE\$' <<<\"\$out\" | grep -q 'flexinfer-worker:[^@ ]*@$DIG\"'
  grep -A1 'name: FLEXINFER_QUANTIZER_GPTQ_ROCM_GFX906_IMAGE\$' <<<\"\$out\" | grep -q 'rocm-gfx906@$DIG\"'
  grep -A1 'name: FLEXINFER_QUANTIZER_GPTQ_IMAGE\$' <<<\"\$out\" | grep -q 'flexinfer-worker:[^@ ]*-cuda\"'
  grep -q 'llamacpp: ghcr.io/flexinfer/flexinfer-llamacpp:[^@ ]*-rocm@$DIG\$' <<<\"\$out\"
  grep -A1 'name: FLEXINFER_LLAMACPP_IMAGE\$' <<<\"\$out\" | grep -q 'flexinfer-llamacpp:[^@ -]*\"'
  grep -A1 'name: FLEXINFER_LLAMACPP_IMAGE_DIGESTS\$' <<<\"\$out\" | grep -q 'value: rocm=$DIG\$'
  ! '$HELM' template x '$CHART' | grep -q FLEXINFER_LLAMACPP_IMAGE_DIGESTS"
ts "schema rejects a digest that is not sha256:<64 hex>" template x "$CHART" --set image.digest=sha256:abc
ts "schema rejects a worker digest for an unknown variant" template x "$CHART" --set worker.image.digests.gpu=$DIG
t "proxy PodDisruptionBudget (minAvailable 1) with two replicas, none with one; zone spread by default, yours instead" bash -c "set -e
  '$HELM' template x '$CHART' --show-only templates/proxy-pdb.yaml | grep -q '^  minAvailable: 1\$'
  '$HELM' template x '$CHART' --show-only templates/proxy-pdb.yaml --set proxy.podDisruptionBudget.minAvailable=50% | grep -q '^  minAvailable: \"50%\"\$'
  ! '$HELM' template x '$CHART' --set proxy.replicas=1 | grep -q 'kind: PodDisruptionBudget'
  ! '$HELM' template x '$CHART' --set proxy.podDisruptionBudget.enabled=false | grep -q 'kind: PodDisruptionBudget'
  '$HELM' template x '$CHART' --show-only templates/proxy-deployment.yaml | grep -q 'topologyKey: topology.kubernetes.io/zone'
  out=\$('$HELM' template x '$CHART' --show-only templates/proxy-deployment.yaml --set-json 'proxy.topologySpreadConstraints=[{\"maxSkew\":2,\"topologyKey\":\"rack\",\"whenUnsatisfiable\":\"DoNotSchedule\"}]')
  grep -q 'topologyKey: rack' <<<\"\$out\" && ! grep -q 'topology.kubernetes.io/zone' <<<\"\$out\""
ts "schema rejects a proxy PDB minAvailable that is neither a number nor a percentage" template x "$CHART" --set proxy.podDisruptionBudget.minAvailable=lots
t "CRDs: the release templates files/crds unchanged but for keep + labels; crds.install=false: none; crds.keep=false: no keep" bash -c "set -e
  '$HELM' template x '$CHART' --show-only templates/crds.yaml | python3 '$HERE/check_crds.py' '$CHART/files/crds' keep
  '$HELM' template x '$CHART' --show-only templates/crds.yaml --set crds.keep=false | python3 '$HERE/check_crds.py' '$CHART/files/crds' nokeep
  ! '$HELM' template x '$CHART' --set crds.install=false | grep -q 'kind: CustomResourceDefinition'"
t "proxy Ingress and HTTPRoute route /v1 to the proxy Service; each refuses to render without hosts / parentRefs" bash -c "set -e
  out=\$('$HELM' template x '$CHART' -f '$HERE/values-all-on.yaml' --show-only templates/proxy-ingress.yaml)
  python3 -c '
import sys, yaml
d = {x[\"kind\"]: x for x in yaml.safe_load_all(sys.stdin) if x}
r = d[\"Ingress\"][\"spec\"][\"rules\"][0]
assert r[\"host\"] == \"llm.example.com\" and d[\"Ingress\"][\"spec\"][\"ingressClassName\"] == \"nginx\", r
p = r[\"http\"][\"paths\"][0]
assert p[\"path\"] == \"/v1\" and p[\"backend\"][\"service\"] == {\"name\": \"x-flexinfer-proxy\", \"port\": {\"name\": \"http\"}}, p
h = d[\"HTTPRoute\"][\"spec\"]
assert h[\"parentRefs\"] == [{\"name\": \"public\", \"namespace\": \"gateways\"}] and h[\"hostnames\"] == [\"llm.example.com\"], h
assert h[\"rules\"][0][\"backendRefs\"] == [{\"name\": \"x-flexinfer-proxy\", \"port\": 8000}], h
' <<<\"\$out\"
  ! '$HELM' template x '$CHART' | grep -qE 'kind: (Ingress|HTTPRoute)\$'
  '$HELM' template x '$CHART' --set proxy.ingress.enabled=true 2>&1 | grep -q 'proxy.ingress.enabled needs at least one entry in proxy.ingress.hosts'
  '$HELM' template x '$CHART' --set proxy.httpRoute.enabled=true 2>&1 | grep -q 'proxy.httpRoute.enabled needs at least one Gateway'"
ts "schema rejects a bad proxy.keepaliveInterval" template x "$CHART" --set proxy.keepaliveInterval=often
ts "schema rejects a non-numeric proxy.maxBodyBytes" template x "$CHART" --set proxy.maxBodyBytes=lots
ts "schema rejects a proxy.bodyMemoryBytes under 1 MiB" template x "$CHART" --set proxy.bodyMemoryBytes=4096
ts "schema rejects a bad proxy.networkPolicy.namespaces entry" template x "$CHART" --set 'proxy.networkPolicy.namespaces={Bad_NS}'
# netpol NAMESPACES EXTRA_RULES HELM-ARGS...: the serving NetworkPolicies are exactly one per namespace listed
netpol() { local want=$1 extra=$2; shift 2; "$HELM" template x "$CHART" -n rel "$@" | python3 "$HERE/check_render.py" netpol "$want" "$extra"; }
t "NetworkPolicy: one per watchNamespaces, proxy.watchNamespace and networkPolicy.namespaces entry; only the proxy reaches serving pods" \
  netpol a,b,c 0 --set 'watchNamespaces={a,b}' --set proxy.watchNamespace=a --set 'proxy.networkPolicy.namespaces={c,b}'
t "NetworkPolicy: all-namespace install, only the listed namespaces" netpol x 0 --set 'proxy.networkPolicy.namespaces={x}'
t "NetworkPolicy: all-namespace install, none listed: none" netpol "" 0
t "NetworkPolicy: extraIngress rules are added after the proxy's" netpol a 1 --set 'watchNamespaces={a}' \
  --set-json 'proxy.networkPolicy.extraIngress=[{"from":[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}],"ports":[{"port":8000}]}]'
t "NetworkPolicy: proxy.networkPolicy.enabled=false renders none" netpol "" 0 --set 'watchNamespaces={a}' --set proxy.networkPolicy.enabled=false
t "NetworkPolicy: proxy.enabled=false renders none" netpol "" 0 --set 'watchNamespaces={a}' --set proxy.enabled=false
t "proxy body limits: unset by default (the proxy derives them from its memory limit), rendered when set" bash -c \
  "'$HELM' template x '$CHART' | grep -q FLEXINFER_PROXY_MAX_BODY_BYTES && exit 1
   out=\$('$HELM' template x '$CHART' --set proxy.maxBodyBytes=1048576 --set proxy.bodyMemoryBytes=33554432 --show-only templates/proxy-deployment.yaml)
   grep -A1 'name: FLEXINFER_PROXY_MAX_BODY_BYTES' <<<\"\$out\" | grep -q '\"1048576\"' \
     && grep -A1 'name: FLEXINFER_PROXY_BODY_MEMORY_BYTES' <<<\"\$out\" | grep -q '\"33554432\"'"
ts "schema rejects an unknown proxy key" template x "$CHART" --set proxy.bogus=1
t "proxy.backendKeys off (default): no Secrets in the proxy's ClusterRole" bash -c \
  "'$HELM' template x '$CHART' | python3 '$HERE/check_render.py' backend-keys off 1"
t "proxy.backendKeys.enabled: get on Secrets, nothing more (ClusterRole)" bash -c \
  "'$HELM' template x '$CHART' --set proxy.backendKeys.enabled=true | python3 '$HERE/check_render.py' backend-keys on 1"
t "proxy.backendKeys.enabled: get on Secrets in each watched namespace's Role" bash -c \
  "'$HELM' template x '$CHART' --set 'watchNamespaces={a,b}' --set proxy.backendKeys.enabled=true \
   | python3 '$HERE/check_render.py' backend-keys on 2"
ts "schema rejects a non-boolean proxy.backendKeys.enabled" template x "$CHART" --set proxy.backendKeys.enabled=yes
t "workerServiceAccount.additionalNamespaces creates SA per namespace" bash -c "'$HELM' template x '$CHART' -n a \
  --set 'workerServiceAccount.additionalNamespaces={b,c,a}' | python3 -c '
import sys,yaml
ns=sorted(d[\"metadata\"][\"namespace\"] for d in yaml.safe_load_all(sys.stdin) if d and d[\"kind\"]==\"ServiceAccount\" and d[\"metadata\"][\"name\"]==\"flexinfer-worker\")
assert ns==[\"a\",\"b\",\"c\"], ns'"
# profile NAME VENDOR KEY=IMAGE... -- HELM-ARGS: the rendered GPUProfile NAME names exactly these runtime images
profile() { local a=(); while [ "$1" != -- ]; do a+=("$1"); shift; done; shift
  "$HELM" template x "$CHART" --set gpuProfiles.enabled=true "$@" | python3 "$HERE/check_render.py" profile "${a[@]}"; }
L=ghcr.io/flexinfer/flexinfer-llamacpp:$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$CHART/Chart.yaml")
t "GPUProfiles: an AMD target outside the HIP build's gets the Vulkan llama.cpp image, ollama and vLLM ROCm as set" \
  profile mi300 amd "llamacpp=$L-vulkan" vllm=docker.io/vllm/vllm-openai-rocm:v0.18.0 -- \
  --set gpuProfiles.profiles.mi300.enabled=true --set gpuProfiles.profiles.mi300.spec.architecture=gfx942 --set gpuProfiles.profiles.mi300.spec.vendor=amd \
  --set gpuProfiles.profiles.mi300.spec.runtime.images.vllm=docker.io/vllm/vllm-openai-rocm:v0.18.0
t "GPUProfiles: a profile's own llama.cpp image is kept; runtimeClassName and supplementalGroups pass through" \
  profile nvidia-sm89 nvidia 'spec.runtimeClassName="nvidia"' 'spec.supplementalGroups=[44,110]' \
  llamacpp=registry.lan/llama:cuda-1 vllm=docker.io/vllm/vllm-openai:v0.18.0 ollama=docker.io/ollama/ollama:0.12.6 \
  exllamav2=ghcr.io/theroyallab/tabbyapi@sha256:cbceb3032963ab7ada80c76649956b01f54e9e0b04a050fb3396c95950c52b03 -- \
  --set gpuProfiles.profiles.nvidia-sm89.spec.runtime.images.llamacpp=registry.lan/llama:cuda-1 \
  --set gpuProfiles.profiles.nvidia-sm89.spec.runtimeClassName=nvidia \
  --set 'gpuProfiles.profiles.nvidia-sm89.spec.supplementalGroups={44,110}'
tn "the profile check refuses a CUDA image on an AMD profile" profile gfx1100 amd \
  "llamacpp=$L-rocm" vllm=docker.io/vllm/vllm-openai:v0.18.0 ollama=docker.io/ollama/ollama:0.12.6-rocm -- \
  --set gpuProfiles.profiles.gfx1100.spec.runtime.images.vllm=docker.io/vllm/vllm-openai:v0.18.0
tn "the profile check refuses an unpinned image" profile gfx906 amd "llamacpp=$L-rocm" ollama=docker.io/ollama/ollama:rocm -- \
  --set gpuProfiles.profiles.gfx906.spec.runtime.images.ollama=docker.io/ollama/ollama:rocm
ts "schema rejects a GPUProfile runtimeClassName that is not a DNS name" template x "$CHART" --set gpuProfiles.profiles.gfx906.spec.runtimeClassName=Nvidia_RT
ts "schema rejects GPUProfile supplementalGroups with root" template x "$CHART" --set 'gpuProfiles.profiles.gfx906.spec.supplementalGroups={0}'
t "deploy/controller and deploy/admission match the chart (render-deploy.sh --check)" bash "$HERE/render-deploy.sh" --check

echo "== static: alerts"
python3 "$HERE/extract-rules.py" "$T/rules-full.yaml" "$T/rules.yaml" < "$T/allon.yaml" >"$T/err" 2>&1 \
  && pass "extract PrometheusRule groups" || fail "extract PrometheusRule groups" "$(cat "$T/err")"
t "promtool check rules" promtool check rules "$T/rules-full.yaml"
t "every alert present" bash -c "for a in FlexInferQuantizationDeadlineApproaching FlexInferQuantizationDeadlineCritical \
  FlexInferQuantizationJobFailed FlexInferQuantizationStalled FlexInferQuantizationOnCPU FlexInferModelCacheFailed \
  FlexInferProxyColdStartTimeouts FlexInferControllerDown; do \
  grep -q \"alert: \$a\$\" '$T/rules-full.yaml' || { echo missing \$a; exit 1; }; done; \
  [ \$(grep -c 'runbook_url: .*gptq-quantization-runbook.md#' '$T/rules-full.yaml') = 8 ]"
t "Grafana dashboard: valid JSON, every panel queries a metric the binaries export" python3 -c "
import json, re, glob, sys
d = json.load(open('$CHART/dashboards/flexinfer.json'))
src = ''.join(open(f).read() for f in glob.glob('crates/*/src/**/*.rs', recursive=True))
used = set()
for p in d['panels']:
    for t in p.get('targets', []):
        used |= {re.sub('_(bucket|sum|count)\$', '', m) for m in re.findall(r'flexinfer_[a-z_]+', t['expr'])}
missing = sorted(m for m in used if '\"' + m + '\"' not in src)
assert used and not missing, missing
print(len(used), 'metrics')"
t "Grafana dashboard ConfigMap renders the JSON" bash -c "'$HELM' template x '$CHART' --set grafanaDashboard.enabled=true \
  --show-only templates/dashboard.yaml | python3 -c 'import sys, yaml, json; d = yaml.safe_load(sys.stdin); \
  assert d[\"metadata\"][\"labels\"][\"grafana_dashboard\"] == \"1\"; json.loads(d[\"data\"][\"flexinfer.json\"])'"
RUNBOOK=docs/user/gptq-quantization-runbook.md
if [ -f "$RUNBOOK" ]; then
  t "runbook_url anchors name sections of $RUNBOOK" python3 "$HERE/check_runbook_anchors.py" "$T/rules-full.yaml" "$RUNBOOK"
else
  echo "skip runbook anchor check: $RUNBOOK not present"
fi
# Default thresholds in the test file come from values.yaml: render the default alerting values for the unit tests.
mkdir -p "$T/alerts"
"$HELM" template flexinfer "$CHART" --set alerting.enabled=true | python3 "$HERE/extract-rules.py" "$T/d-full.yaml" "$T/alerts/rules.yaml" >/dev/null
cp "$HERE/alerts.test.yaml" "$T/alerts/"
t "promtool test rules (each alert fires on time and stays quiet otherwise)" promtool test rules "$T/alerts/alerts.test.yaml"
# A rule that can never fire would pass "stays quiet" checks: make sure the fire cases are really exercised by
# breaking the rules (impossible thresholds) and expecting the unit tests to fail.
mkdir -p "$T/broken"; cp "$HERE/alerts.test.yaml" "$T/broken/"
"$HELM" template flexinfer "$CHART" --set alerting.enabled=true --set alerting.deadlineApproaching.threshold=1 \
  --set alerting.deadlineCritical.threshold=1 --set alerting.stalled.thresholdSeconds=999999 \
  --set alerting.jobFailed.window=1m --set alerting.controllerDown.upSelector='job="nope"' --set alerting.modelCacheFailed.for=1h \
  --set alerting.proxyColdStartTimeouts.for=1h --set alerting.quantizedOnCPU.for=1h \
  | python3 "$HERE/extract-rules.py" "$T/broken/full.yaml" "$T/broken/rules.yaml" >/dev/null 2>&1
t "promtool tests detect broken rules (mutation check)" bash -c "out=\$(promtool test rules '$T/broken/alerts.test.yaml' 2>&1); rc=\$?; \
  [ \$rc -ne 0 ] || exit 1; for a in DeadlineApproaching DeadlineCritical JobFailed Stalled OnCPU ModelCacheFailed ProxyColdStartTimeouts ControllerDown; do \
  grep -q \"FlexInferQuantization\$a\|FlexInfer\$a\" <<<\"\$out\" || { echo \"mutation of \$a not detected\"; exit 1; }; done"

echo "== static: kustomize bases"
BASES=(deploy/controller deploy/admission deploy/gpuprofiles deploy/modelcaches deploy/models deploy/flux)
[ -f deploy/crds/kustomization.yaml ] && BASES=(deploy/crds "${BASES[@]}")
for b in "${BASES[@]}"; do
  kubectl kustomize "$b" > "$T/kz-$(basename "$b").yaml" 2>"$T/err" && [ -s "$T/kz-$(basename "$b").yaml" ] \
    && pass "kubectl kustomize $b" || fail "kubectl kustomize $b" "$(cat "$T/err")"
done
t "kustomize output: cluster-scoped objects carry no namespace" python3 "$HERE/check_cluster_scoped.py" "$T"/kz-*.yaml

echo "== static: deploy-quantizer worker image variants (refused before any cluster call)"
# rejected_dq MESSAGE ARGS...: deploy-quantizer exits non-zero and names MESSAGE
rejected_dq() { local m=$1 out; shift
  if out=$(bash scripts/deploy-quantizer.sh "$@" --registry r.example:5000 --dry-run 2>&1); then echo "succeeded: $out"; return 1; fi
  grep -qF "$m" <<<"$out" || { echo "$out"; return 1; }; }
t "deploy-quantizer refuses an AMD target without a code object unless --variant is given" \
  rejected_dq "no worker image variant for gfx1103: HIP code objects are built for gfx1100 and gfx906 only" gfx1103
t "deploy-quantizer refuses an unknown --variant" rejected_dq "bad --variant 'rocm-gfx1103'" gfx1100 --variant rocm-gfx1103

if [ -z "${KUBECONFIG:-}" ]; then
  if [ "${CHART_TESTS_STATIC_ONLY:-0}" = 1 ]; then
    echo "CHART_TESTS_STATIC_ONLY=1: live API-server checks skipped"
  else
    fail "live checks: KUBECONFIG is not set (start one with scripts/testenv/up.sh api)"
  fi
  echo "$PASS passed, $FAIL failed"; [ "$FAIL" = 0 ]; exit
fi

echo "== live: API server $(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}' 2>/dev/null), namespace $NS"
LIVE=1
if ! kubectl get ns default >/dev/null 2>&1; then fail "API server reachable"; echo "$PASS passed, $FAIL failed"; exit 1; fi
kubectl create ns "$NS" >/dev/null && kubectl create ns "$NS-other" >/dev/null
# The controller must satisfy the "restricted" Pod Security Standard: the API server warns on violations.
kubectl label ns "$NS" pod-security.kubernetes.io/warn=restricted pod-security.kubernetes.io/enforce=restricted >/dev/null
kubectl get crd servicemonitors.monitoring.coreos.com httproutes.gateway.networking.k8s.io >/dev/null 2>&1 || CREATED_STUBS=1
if [ "$CREATED_STUBS" = 1 ]; then
  t "install stand-in monitoring/flux CRDs" kubectl apply -f "$HERE/fixtures/stub-crds.yaml"
else
  t "stand-in monitoring/flux CRDs present" kubectl apply -f "$HERE/fixtures/stub-crds.yaml" --dry-run=server
fi
CRD_DIR=${CHART_TESTS_CRD_DIR:-deploy/crds}   # override only while developing before `make crds` has run
CRD_FILES=$(ls "$CRD_DIR"/*.ai.flexinfer.yaml 2>/dev/null)
if [ -z "$CRD_FILES" ]; then
  fail "ai.flexinfer CRDs: $CRD_DIR/*.ai.flexinfer.yaml missing (run make crds)"
else
  # shellcheck disable=SC2086
  t "install ai.flexinfer CRDs from $CRD_DIR" kubectl apply --server-side --force-conflicts $(printf -- '-f %s ' $CRD_FILES)
fi
t "CRDs established" kubectl wait --for=condition=Established --timeout=60s \
  crd/modelcaches.ai.flexinfer crd/models.ai.flexinfer crd/gpuprofiles.ai.flexinfer \
  crd/servicemonitors.monitoring.coreos.com crd/prometheusrules.monitoring.coreos.com \
  crd/gitrepositories.source.toolkit.fluxcd.io crd/kustomizations.kustomize.toolkit.fluxcd.io crd/httproutes.gateway.networking.k8s.io

echo "== live: server-side dry-run of rendered chart"
for mode in default allon; do
  # proxy.watchNamespace: the all-on serving NetworkPolicy goes to the namespace applied to.
  f=$([ $mode = default ] && echo "" || echo "-f $HERE/values-all-on.yaml --set proxy.watchNamespace=$NS")
  # shellcheck disable=SC2086
  "$HELM" template "dry-$RUN_ID" "$CHART" -n "$NS" $f > "$T/ns-$mode.yaml"
  t "server-side dry-run: helm template ($mode), no PodSecurity (restricted) warnings" bash -c \
    "out=\$(kubectl apply --dry-run=server -n '$NS' -f '$T/ns-$mode.yaml' 2>&1) || { echo \"\$out\"; exit 1; }; \
     ! grep -i 'podsecurity\|would violate' <<<\"\$out\""
done

echo "== live: helm install"
INSTALL_ARGS=(-f "$HERE/values-all-on.yaml" --set "admissionPolicy.namespaceSelector.matchLabels.kubernetes\.io/metadata\.name=$NS"
              --set "workerServiceAccount.additionalNamespaces={$NS-other}" --set "proxy.watchNamespace=$NS-other"
              --set "admissionPolicy.reservedModelNames.$NS-other={held,shared-default}"
              --set "admissionPolicy.reservedModelNames.$NS={own-name}")
# The CRDs were applied with kubectl above, as an earlier chart version's crds/ folder left them: the release takes
# them over once (--take-ownership, docs/user/install.md "Upgrading") and owns them from then on.
t "helm install (takes over the CRDs applied before it)" "$HELM" install "$REL" "$CHART" -n "$NS" "${INSTALL_ARGS[@]}" --take-ownership
t "the release owns the CRDs and keeps them on uninstall (helm.sh/resource-policy: keep)" bash -c "set -e
  for c in modelcaches models gpuprofiles; do
    a=\$(kubectl get crd \$c.ai.flexinfer -o json)
    python3 -c 'import json,sys; a=json.loads(sys.argv[1])[\"metadata\"][\"annotations\"]; assert a[\"meta.helm.sh/release-name\"]==\"$REL\" and a[\"helm.sh/resource-policy\"]==\"keep\", a' \"\$a\"
  done"
DEP=$REL-flexinfer-controller
SA=system:serviceaccount:$NS:$REL-flexinfer-controller
t "controller Deployment created with the expected env" bash -c \
  "kubectl -n '$NS' get deploy '$DEP' -o json | python3 '$HERE/check_render.py' live-env allon"
t "the serving NetworkPolicy is in $NS-other (proxy.watchNamespace; accepted by the API server)" \
  kubectl -n "$NS-other" get networkpolicy "$REL-flexinfer-proxy-serving"
t "NOTES: every Model's own policy, the namespaces with the chart's policy, or isolation off" bash -c "set -e
  '$HELM' get notes '$REL' -n '$NS' | grep -q 'in $NS-other the NetworkPolicy $REL-flexinfer-proxy-serving also applies'
  '$HELM' install '$REL-notes' '$CHART' -n '$NS-notes' --dry-run=client --set crds.install=false | grep -q 'Every Model gets a NetworkPolicy of its own'
  '$HELM' install '$REL-notes' '$CHART' -n '$NS-notes' --dry-run=client --set crds.install=false --set proxy.networkPolicy.enabled=false | grep -q 'reachable from any pod'"
t "metrics Service, ServiceMonitor, PrometheusRule, GPUProfiles, worker SAs exist" bash -c "set -e
  kubectl -n '$NS' get svc/'$DEP-metrics' servicemonitor/'$DEP' prometheusrule/'$REL-flexinfer-alerts' >/dev/null
  [ \$(kubectl -n '$NS' get gpuprofiles -o name | wc -l) = 3 ]
  [ \"\$(kubectl -n '$NS-other' get sa flexinfer-worker -o jsonpath='{.automountServiceAccountToken}')\" = false ]
  [ \"\$(kubectl -n '$NS' get sa flexinfer-worker -o jsonpath='{.automountServiceAccountToken}')\" = false ]"

echo "== live: RBAC matrix (as $SA, with a ServiceAccount token)"
# sa_kubeconfig SA OUT: a kubeconfig that authenticates with a TokenRequest token of the ServiceAccount only.
sa_kubeconfig() {  # sa_kubeconfig SA OUT [NAMESPACE]
  local tok srv ca
  tok=$(kubectl -n "${3:-$NS}" create token "$1" --duration=15m) || return 1
  srv=$(kubectl config view --minify --raw -o jsonpath='{.clusters[0].cluster.server}')
  ca=$(kubectl config view --minify --raw -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')
  if [ -n "$ca" ]; then echo "$ca" | base64 -d > "$2.ca"
  else cp "$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.certificate-authority}')" "$2.ca"; fi
  kubectl config --kubeconfig="$2" set-cluster t --server="$srv" --certificate-authority="$2.ca" --embed-certs=true >/dev/null &&
  kubectl config --kubeconfig="$2" set-credentials sa --token="$tok" >/dev/null &&
  kubectl config --kubeconfig="$2" set-context t --cluster=t --user=sa >/dev/null &&
  kubectl config --kubeconfig="$2" use-context t >/dev/null
}
sa_kubeconfig "$REL-flexinfer-controller" "$T/sa.kubeconfig"
sa_kubeconfig flexinfer-worker "$T/worker.kubeconfig"
t "controller token authenticates as $SA" bash -c \
  "[ \"\$(kubectl --kubeconfig='$T/sa.kubeconfig' auth whoami -o jsonpath='{.status.userInfo.username}')\" = '$SA' ]"
can() { kubectl --kubeconfig="$T/sa.kubeconfig" auth can-i "$@" 2>/dev/null; }
rbac_yes=(
  "get modelcaches.ai.flexinfer" "list modelcaches.ai.flexinfer" "watch modelcaches.ai.flexinfer"
  "patch modelcaches.ai.flexinfer" "update modelcaches.ai.flexinfer"
  "get models.ai.flexinfer" "list models.ai.flexinfer" "watch models.ai.flexinfer" "patch models.ai.flexinfer" "update models.ai.flexinfer"
  "get gpuprofiles.ai.flexinfer" "list gpuprofiles.ai.flexinfer" "watch gpuprofiles.ai.flexinfer"
  "patch gpuprofiles.ai.flexinfer" "update gpuprofiles.ai.flexinfer"
  "get modelcaches.ai.flexinfer --subresource=status" "patch modelcaches.ai.flexinfer --subresource=status"
  "update modelcaches.ai.flexinfer --subresource=status"
  "patch models.ai.flexinfer --subresource=status" "update models.ai.flexinfer --subresource=status"
  "patch gpuprofiles.ai.flexinfer --subresource=status" "update gpuprofiles.ai.flexinfer --subresource=status"
  "update modelcaches.ai.flexinfer --subresource=finalizers" "update models.ai.flexinfer --subresource=finalizers"
  "get jobs.batch" "list jobs.batch" "watch jobs.batch" "create jobs.batch" "delete jobs.batch" "patch jobs.batch"
  "get pods" "list pods" "watch pods" "get pods --subresource=log"
  "get persistentvolumeclaims" "list persistentvolumeclaims" "watch persistentvolumeclaims"
  "create persistentvolumeclaims" "delete persistentvolumeclaims"
  "get deployments.apps" "list deployments.apps" "watch deployments.apps" "create deployments.apps"
  "patch deployments.apps" "update deployments.apps" "delete deployments.apps"
  "get services" "list services" "watch services" "create services" "patch services" "update services" "delete services"
  "create events" "patch events" "create events.events.k8s.io" "patch events.events.k8s.io"
)
rbac_no=(
  "get secrets" "list secrets" "watch secrets" "create pods" "delete pods" "create pods --subresource=exec"
  "delete modelcaches.ai.flexinfer" "create modelcaches.ai.flexinfer" "delete customresourcedefinitions.apiextensions.k8s.io"
  "create clusterroles.rbac.authorization.k8s.io" "create rolebindings.rbac.authorization.k8s.io"
  "delete persistentvolumes" "get nodes" "create serviceaccounts" "create serviceaccounts --subresource=token"
  "update configmaps"
)
bad_yes=(); for v in "${rbac_yes[@]}"; do
  for n in "$NS" "$NS-other"; do
    # shellcheck disable=SC2086
    [ "$(can $v -n "$n")" = yes ] || bad_yes+=("$v -n $n")
  done
done
[ ${#bad_yes[@]} = 0 ] && pass "RBAC: all ${#rbac_yes[@]} needed verbs allowed in every namespace" \
  || fail "RBAC: needed verbs denied" "$(printf '%s\n' "${bad_yes[@]}")"
bad_no=(); for v in "${rbac_no[@]}"; do
  for n in "$NS" "$NS-other" kube-system; do
    # shellcheck disable=SC2086
    [ "$(can $v -n "$n")" = no ] || bad_no+=("$v -n $n")
  done
done
[ "$(can get secrets --all-namespaces)" = no ] || bad_no+=("get secrets --all-namespaces")
[ ${#bad_no[@]} = 0 ] && pass "RBAC: Secrets (any namespace) and ${#rbac_no[@]} other verbs denied" \
  || fail "RBAC: verbs that must be denied are allowed" "$(printf '%s\n' "${bad_no[@]}")"
lease=$(for v in get create update; do can "$v" leases.coordination.k8s.io -n "$NS"; done | sort -u)
[ "$lease" = yes ] && [ "$(can get leases.coordination.k8s.io -n "$NS-other")" = no ] \
  && pass "RBAC: Lease get/create/update only in the release namespace" || fail "RBAC: Lease scope" "release ns: $lease"
WSA=system:serviceaccount:$NS:flexinfer-worker
wbad=$(for v in "get secrets" "get pods" "get modelcaches.ai.flexinfer" "create jobs.batch" "get configmaps"; do
  # shellcheck disable=SC2086
  [ "$(kubectl --kubeconfig="$T/worker.kubeconfig" auth can-i $v -n "$NS" 2>/dev/null)" = no ] || echo "worker may: $v"; done)
[ "$(kubectl --kubeconfig="$T/worker.kubeconfig" auth whoami -o jsonpath='{.status.userInfo.username}' 2>/dev/null)" = "$WSA" ] \
  || wbad="$wbad worker token does not authenticate as $WSA"
[ -z "$wbad" ] && pass "RBAC: worker ServiceAccount has no API access" || fail "RBAC: worker ServiceAccount" "$wbad"

PSA=system:serviceaccount:$NS:$REL-flexinfer-proxy
sa_kubeconfig "$REL-flexinfer-proxy" "$T/proxy.kubeconfig"
pcan() { kubectl --kubeconfig="$T/proxy.kubeconfig" auth can-i "$@" 2>/dev/null; }
proxy_yes=("get models.ai.flexinfer" "list models.ai.flexinfer" "watch models.ai.flexinfer"
  "get models.ai.flexinfer --subresource=status" "patch models.ai.flexinfer --subresource=status"
  "list endpointslices.discovery.k8s.io" "watch endpointslices.discovery.k8s.io" "list services" "watch services")
proxy_no=("get secrets" "list secrets" "patch models.ai.flexinfer" "update models.ai.flexinfer" "create models.ai.flexinfer"
  "delete models.ai.flexinfer" "update models.ai.flexinfer --subresource=status" "get modelcaches.ai.flexinfer"
  "create endpointslices.discovery.k8s.io" "patch deployments.apps" "create pods" "get pods" "create events"
  "create services" "patch services" "delete services")
pbad=$(for v in "${proxy_yes[@]}"; do for n in "$NS" "$NS-other"; do
  # shellcheck disable=SC2086
  [ "$(pcan $v -n "$n")" = yes ] || echo "proxy may not: $v -n $n"; done; done
  for v in "${proxy_no[@]}"; do for n in "$NS" kube-system; do
  # shellcheck disable=SC2086
  [ "$(pcan $v -n "$n")" = no ] || echo "proxy may: $v -n $n"; done; done)
[ "$(kubectl --kubeconfig="$T/proxy.kubeconfig" auth whoami -o jsonpath='{.status.userInfo.username}' 2>/dev/null)" = "$PSA" ] \
  || pbad="$pbad proxy token does not authenticate as $PSA"
[ -z "$pbad" ] && pass "RBAC: proxy ServiceAccount: ${#proxy_yes[@]} needed verbs allowed, ${#proxy_no[@]} others (Secrets, Model specs) denied" \
  || fail "RBAC: proxy ServiceAccount" "$pbad"

echo "== live: namespace-scoped install (watchNamespaces)"
SREL=$REL-scoped
kubectl create ns "$NS-scoped" >/dev/null && kubectl create ns "$NS-watched" >/dev/null
t "helm install with watchNamespaces={$NS-watched}" "$HELM" install "$SREL" "$CHART" -n "$NS-scoped" \
  --set "watchNamespaces={$NS-watched}" --set admissionPolicy.enabled=false --set crds.install=false
t "namespace-scoped: the serving NetworkPolicy is in $NS-watched (accepted by the API server)" \
  kubectl -n "$NS-watched" get networkpolicy "$SREL-flexinfer-proxy-serving"
t "namespace-scoped: no ClusterRole or ClusterRoleBinding of the release" bash -c \
  "[ -z \"\$(kubectl get clusterroles,clusterrolebindings -l app.kubernetes.io/instance='$SREL' -o name)\" ]"
t "namespace-scoped: controller and proxy watch only $NS-watched" bash -c "set -e
  kubectl -n '$NS-scoped' get deploy '$SREL-flexinfer-controller' -o jsonpath='{.spec.template.spec.containers[0].env}' | grep -q '\"FLEXINFER_WATCH_NAMESPACE\",\"value\":\"$NS-watched\"'
  kubectl -n '$NS-scoped' get deploy '$SREL-flexinfer-proxy' -o jsonpath='{.spec.template.spec.containers[0].env}' | grep -q '\"FLEXINFER_PROXY_WATCH_NAMESPACE\",\"value\":\"$NS-watched\"'
  [ \"\$(kubectl -n '$NS-watched' get sa flexinfer-worker -o jsonpath='{.automountServiceAccountToken}')\" = false ]"
sa_kubeconfig "$SREL-flexinfer-controller" "$T/ssa.kubeconfig" "$NS-scoped"
sa_kubeconfig "$SREL-flexinfer-proxy" "$T/spsa.kubeconfig" "$NS-scoped"
scan() { kubectl --kubeconfig="$T/ssa.kubeconfig" auth can-i "$@" 2>/dev/null; }
spcan() { kubectl --kubeconfig="$T/spsa.kubeconfig" auth can-i "$@" 2>/dev/null; }
sbad=""
for v in "${rbac_yes[@]}"; do
  # shellcheck disable=SC2086
  [ "$(scan $v -n "$NS-watched")" = yes ] || sbad="$sbad|denied in $NS-watched: $v"
  # shellcheck disable=SC2086
  [ "$(scan $v -n "$NS-other")" = no ] || sbad="$sbad|allowed in $NS-other: $v"
done
for v in "list modelcaches.ai.flexinfer" "create jobs.batch" "delete persistentvolumeclaims" "create deployments.apps"; do
  # shellcheck disable=SC2086
  [ "$(scan $v --all-namespaces)" = no ] || sbad="$sbad|allowed cluster-wide: $v"
done
[ "$(scan get secrets -n "$NS-watched")" = no ] || sbad="$sbad|secrets allowed"
[ "$(scan update leases.coordination.k8s.io -n "$NS-scoped")" = yes ] || sbad="$sbad|no Lease in the release namespace"
for v in "list models.ai.flexinfer" "watch endpointslices.discovery.k8s.io" "watch services" "patch models.ai.flexinfer --subresource=status"; do
  # shellcheck disable=SC2086
  [ "$(spcan $v -n "$NS-watched")" = yes ] || sbad="$sbad|proxy denied in $NS-watched: $v"
  # shellcheck disable=SC2086
  [ "$(spcan $v -n "$NS-other")" = no ] || sbad="$sbad|proxy allowed in $NS-other: $v"
done
[ -z "$sbad" ] && pass "RBAC (namespace-scoped): ${#rbac_yes[@]} controller verbs only in $NS-watched, nothing cluster-wide, proxy likewise" \
  || fail "RBAC (namespace-scoped)" "${sbad//|/$'\n'}"
t "namespace-scoped: helm uninstall" "$HELM" uninstall "$SREL" -n "$NS-scoped"
kubectl delete ns "$NS-scoped" "$NS-watched" --wait=false >/dev/null 2>&1 || true

echo "== live: promotion-gate admission policy"
model() {  # model NAME ANNOTATIONS_JSON SERVERLESS_JSON CONFIG_JSON
  cat <<EOF
{"apiVersion":"ai.flexinfer/v1alpha2","kind":"Model","metadata":{"name":"$1","namespace":"$NS","annotations":$2},
 "spec":{"backend":"vllm","source":"modelcache://qwen","serverless":$3,"config":$4}}
EOF
}
GATE='"flexinfer.ai/promotion-gate":"quantized-artifact-v1"'
# The policy is enforced a moment after it is created: retry the first rejection for up to 30 s.
deny_out=""; for _ in $(seq 1 30); do
  if deny_out=$(model warm-minreplicas "{$GATE}" '{"enabled":true,"minReplicas":1}' '{}' | kubectl apply --dry-run=server -f - 2>&1); then
    sleep 1; else break; fi
done
grep -q "flexinfer.ai/promotion-validation" <<<"$deny_out" && grep -q "flexinfer.ai/promotion-evidence" <<<"$deny_out" \
  && grep -qi "denied\|forbidden" <<<"$deny_out" \
  && pass "admission: gated Model with minReplicas>0 and no validation is denied; message names the annotations" \
  || fail "admission: gated warm Model (minReplicas) denied with message" "$deny_out"
deny() { local n=$1 out; shift; if out=$(model "$@" | kubectl create -f - 2>&1); then
    fail "admission: $n denied" "created: $out"; else
    grep -q "flexinfer.ai/promotion-validation" <<<"$out" && pass "admission: $n denied" || fail "admission: $n denied" "$out"; fi; }
admit() { local n=$1; shift; t "admission: $n admitted" bash -c "kubectl create -f - <<<'$(model "$@")'"; }
deny "gated serverless-disabled Model" warm-disabled "{$GATE}" '{"enabled":false}' '{}'
deny "gated warmPolicy=primary Model" warm-primary "{$GATE}" '{"enabled":true,"minReplicas":0}' '{"warmPolicy":"primary"}'
deny "gated warm Model with empty evidence" warm-empty "{$GATE,\"flexinfer.ai/promotion-evidence\":\"\"}" '{"enabled":false}' '{}'
deny "gated warm Model with validation=failed" warm-failed "{$GATE,\"flexinfer.ai/promotion-validation\":\"failed\"}" '{"enabled":true,"minReplicas":2}' '{}'
admit "validated gated warm Model" validated "{$GATE,\"flexinfer.ai/promotion-validation\":\"passed\"}" '{"enabled":true,"minReplicas":1}' '{"warmPolicy":"primary"}'
admit "gated warm Model with evidence" evidence "{$GATE,\"flexinfer.ai/promotion-evidence\":\"https://ci.example/run/42\"}" '{"enabled":false}' '{}'
admit "gated canary Model" canary "{$GATE}" '{"enabled":true,"minReplicas":0}' '{"warmPolicy":"ondemand"}'
admit "ungated warm Model" ungated '{"team":"ml"}' '{"enabled":false}' '{"warmPolicy":"primary"}'
admit "other gate value" othergate '{"flexinfer.ai/promotion-gate":"something-else"}' '{"enabled":false}' '{}'
t "admission: promoting a canary without validation is denied on UPDATE" bash -c \
  "out=\$(kubectl -n '$NS' patch model canary --type merge -p '{\"spec\":{\"serverless\":{\"minReplicas\":1}}}' 2>&1) && exit 1; grep -q promotion-validation <<<\"\$out\""
t "admission: removing the gate annotation without evidence is denied on UPDATE" bash -c \
  "out=\$(kubectl -n '$NS' annotate model canary flexinfer.ai/promotion-gate- 2>&1) && exit 1; grep -q 'removing or changing' <<<\"\$out\""
t "admission: changing the gate value without evidence is denied on UPDATE" bash -c \
  "out=\$(kubectl -n '$NS' annotate --overwrite model canary flexinfer.ai/promotion-gate=off 2>&1) && exit 1; grep -q 'removing or changing' <<<\"\$out\""
t "admission: a gated canary stays a canary (still gated after the refused updates)" bash -c \
  "[ \"\$(kubectl -n '$NS' get model canary -o jsonpath='{.metadata.annotations.flexinfer\.ai/promotion-gate}')\" = quantized-artifact-v1 ]"
t "admission: promoting after validation is admitted" bash -c \
  "kubectl -n '$NS' annotate model canary flexinfer.ai/promotion-validation=passed && \
   kubectl -n '$NS' patch model canary --type merge -p '{\"spec\":{\"serverless\":{\"minReplicas\":1}}}'"
t "admission: binding is scoped (other namespace not enforced)" bash -c \
  "kubectl create -f - <<<'$(model scoped "{$GATE}" '{"enabled":false}' '{}' | sed "s/\"namespace\":\"$NS\"/\"namespace\":\"$NS-other\"/")'"

echo "== live: reserved Model names admission policy"
named() {  # named NAME ALIASES_JSON
  echo "{\"apiVersion\":\"ai.flexinfer/v1alpha2\",\"kind\":\"Model\",\"metadata\":{\"name\":\"$1\",\"namespace\":\"$NS\"},
 \"spec\":{\"backend\":\"vllm\",\"source\":\"modelcache://qwen\",\"aliases\":$2}}"
}
# Like the gate above: the policy is enforced a moment after it is created.
names_out=""; for _ in $(seq 1 30); do
  if names_out=$(named held '[]' | kubectl apply --dry-run=server -f - 2>&1); then sleep 1; else break; fi
done
grep -q "metadata.name: held is reserved to namespace $NS-other" <<<"$names_out" \
  && pass "admission: a Model named after another namespace's reserved name is denied; message names field and namespace" \
  || fail "admission: reserved name denied" "$names_out"
deny_named() { local n=$1 want=$2 out; shift 2; if out=$(named "$@" | kubectl create -f - 2>&1); then
    fail "admission: $n denied" "created: $out"; else
    grep -qF "$want" <<<"$out" && pass "admission: $n denied" || fail "admission: $n denied" "$out"; fi; }
deny_named "alias reserved to another namespace" "spec.aliases: shared-default is reserved to namespace $NS-other" \
  taker '["mine","shared-default"]'
deny_named "alias <namespace>/… of a namespace that reserves names" "spec.aliases: $NS-other/held names namespace $NS-other" \
  taker2 "[\"$NS-other/held\"]"
t "admission: free names, and a namespace's own reserved name, are admitted" bash -c \
  "kubectl create -f - <<<'$(named free '["mine","meta-llama/Llama-3.1-8B"]')' && kubectl create -f - <<<'$(named own-name '[]')'"
t "admission: adding a reserved alias on UPDATE is denied" bash -c \
  "out=\$(kubectl -n '$NS' patch model free --type merge -p '{\"spec\":{\"aliases\":[\"held\"]}}' 2>&1) && exit 1; \
   grep -q 'spec.aliases: held is reserved' <<<\"\$out\""

echo "== live: CRD limits"
LIM=$(mktemp -d)
long=$(printf 'x%.0s' $(seq 1 100))
sel=$(for i in $(seq 1 33); do printf '"k%d":"v",' "$i"; done)
cat >"$LIM/shared.json" <<EOF
{"apiVersion":"ai.flexinfer/v1alpha2","kind":"Model","metadata":{"name":"long","namespace":"$NS"},
 "spec":{"backend":"vllm","source":"pvc://c/p","gpu":{"shared":"$long"}}}
EOF
cat >"$LIM/selector.json" <<EOF
{"apiVersion":"ai.flexinfer/v1alpha2","kind":"Model","metadata":{"name":"sel","namespace":"$NS"},
 "spec":{"backend":"vllm","source":"pvc://c/p","nodeSelector":{${sel%,}}}}
EOF
rejected() {  # rejected FILE FIELD: a server-side dry run fails and the error names FIELD
  local out; if out=$(kubectl apply --dry-run=server -f "$1" 2>&1); then echo "accepted: $out"; return 1; fi
  grep -q "$2" <<<"$out" || { echo "$out"; return 1; }; }
t "CRD limits: an over-long gpu.shared is rejected naming the field" rejected "$LIM/shared.json" 'spec.gpu.shared'
t "CRD limits: 33 nodeSelector entries are rejected naming the field" rejected "$LIM/selector.json" 'spec.nodeSelector'

echo "== live: helm upgrade"
kubectl -n "$NS" apply -f - >/dev/null 2>&1 <<EOF
apiVersion: ai.flexinfer/v1alpha1
kind: ModelCache
metadata: {name: upgrade-probe}
spec: {source: "Qwen/Qwen2.5-0.5B-Instruct"}
EOF
uid_before=$(kubectl get crd modelcaches.ai.flexinfer -o jsonpath='{.metadata.uid}')
t "helm upgrade (logLevel=debug, gpuProfiles off)" "$HELM" upgrade "$REL" "$CHART" -n "$NS" "${INSTALL_ARGS[@]}" \
  --set controller.logLevel=debug --set gpuProfiles.profiles.gfx906.enabled=false
t "after upgrade: CRDs kept (same uid), ModelCache and Models kept, env updated, revision 2" bash -c "set -e
  [ \"\$(kubectl get crd modelcaches.ai.flexinfer -o jsonpath='{.metadata.uid}')\" = '$uid_before' ]
  kubectl get crd models.ai.flexinfer gpuprofiles.ai.flexinfer >/dev/null
  kubectl -n '$NS' get modelcache/upgrade-probe model/validated model/canary >/dev/null
  [ \"\$(kubectl -n '$NS' get deploy '$DEP' -o jsonpath='{.spec.template.spec.containers[0].env[?(@.name==\"RUST_LOG\")].value}')\" = debug ]
  [ \$(kubectl -n '$NS' get gpuprofiles -o name | wc -l) = 2 ]
  kubectl -n '$NS' get svc/'$DEP-metrics' prometheusrule/'$REL-flexinfer-alerts' validatingadmissionpolicy/'$REL-flexinfer-promotion-gate' >/dev/null
  '$HELM' -n '$NS' history '$REL' -o json | python3 -c 'import json,sys; h=json.load(sys.stdin); assert h[-1][\"revision\"]==2 and h[-1][\"status\"]==\"deployed\", h'"
# A new chart version whose CRD changed (a short name added): helm upgrade applies it, and the previous chart
# takes it back out — the CRDs follow the chart, with the same uid and every object kept.
cp -r "$CHART" "$T/chart-next"
sed -i 's/^    - mdl$/    - mdl\n    - mdlnext/' "$T/chart-next/files/crds/models.ai.flexinfer.yaml"
t "helm upgrade applies a changed CRD of the new chart version, and the old one takes it back" bash -c "set -e
  grep -q '^    - mdlnext\$' '$T/chart-next/files/crds/models.ai.flexinfer.yaml'
  uid=\$(kubectl get crd models.ai.flexinfer -o jsonpath='{.metadata.uid}')
  '$HELM' upgrade '$REL' '$T/chart-next' -n '$NS' --reuse-values >/dev/null
  kubectl get crd models.ai.flexinfer -o jsonpath='{.spec.names.shortNames}' | grep -q mdlnext
  '$HELM' upgrade '$REL' '$CHART' -n '$NS' --reuse-values >/dev/null
  ! kubectl get crd models.ai.flexinfer -o jsonpath='{.spec.names.shortNames}' | grep -q mdlnext
  [ \"\$(kubectl get crd models.ai.flexinfer -o jsonpath='{.metadata.uid}')\" = \"\$uid\" ]
  kubectl -n '$NS' get modelcache/upgrade-probe model/validated model/canary >/dev/null"

echo "== live: kustomize bases, server-side dry-run"
for b in "${BASES[@]}"; do
  o=$T/kz-$(basename "$b").yaml
  # Re-home namespaced objects (and RBAC subjects) into the test namespace so nothing outside it is touched.
  python3 -c '
import sys, yaml
ns = sys.argv[1]
docs = [d for d in yaml.safe_load_all(open(sys.argv[2])) if d]
for d in docs:
    if d["metadata"].get("namespace"):
        d["metadata"]["namespace"] = ns
    for s in d.get("subjects") or []:
        if s.get("namespace"):
            s["namespace"] = ns
yaml.safe_dump_all(docs, open(sys.argv[2] + ".ns.yaml", "w"))
' "$NS" "$o" 2>"$T/err" || { fail "server-side dry-run $b" "$(cat "$T/err")"; continue; }
  t "server-side dry-run $b" kubectl apply --dry-run=server -f "$o.ns.yaml"
done

echo "== live: make deploy-quantizer (scripts/deploy-quantizer.sh)"
# A GPUProfile of an architecture no other test uses, in the test namespace only.
DQ_ARCH=gfx1103
DQ_IMG() { kubectl -n "$NS" get gpuprofile dq -o jsonpath='{.spec.quantization.images.GPTQ}'; }
kubectl -n "$NS" apply -f - >/dev/null <<YAML
apiVersion: ai.flexinfer/v1alpha2
kind: GPUProfile
metadata: {name: dq}
spec:
  architecture: $DQ_ARCH
  vendor: amd
  quantization: {images: {GPTQ: "registry.example.com/flexinfer/worker:old"}}
YAML
t "deploy-quantizer refuses an architecture without a GPUProfile, naming it" bash -c "
  if out=\$(bash scripts/deploy-quantizer.sh gfx1151 --variant cpu --registry r.example:5000 -n '$NS' --dry-run 2>&1); then
    echo \"succeeded: \$out\"; exit 1; fi
  grep -q 'no GPUProfile with spec.architecture=gfx1151 in namespace $NS' <<<\"\$out\" || { echo \"\$out\"; exit 1; }"
tn "deploy-quantizer refuses a malformed --restart" bash scripts/deploy-quantizer.sh "$DQ_ARCH" --variant cpu --registry r.example:5000 -n "$NS" --restart nocache --dry-run
t "deploy-quantizer --dry-run checks the patch server-side and changes nothing" bash -c "set -e
  out=\$(bash scripts/deploy-quantizer.sh '$DQ_ARCH' --variant cpu --registry r.example:5000 --tag t1 -n '$NS' --dry-run 2>&1)
  grep -q 'GPUProfile $NS/dq: quantization.images.GPTQ registry.example.com/flexinfer/worker:old -> r.example:5000/flexinfer/worker:t1 (server-side dry run' <<<\"\$out\"
  [ \"\$(kubectl -n '$NS' get gpuprofile dq -o jsonpath='{.spec.quantization.images.GPTQ}')\" = registry.example.com/flexinfer/worker:old ]"
# The worker image variant follows the architecture (scripts/images/variants.sh): one profile per mapped
# architecture, the plan line and the patched reference checked for each.
for a in gfx1100 gfx906 sm_90; do
  kubectl -n "$NS" apply -f - >/dev/null <<YAML
apiVersion: ai.flexinfer/v1alpha2
kind: GPUProfile
metadata: {name: dq-${a//_/-}}
spec:
  architecture: $a
  vendor: $([ "${a#sm_}" != "$a" ] && echo nvidia || echo amd)
  quantization: {images: {GPTQ: "registry.example.com/flexinfer/worker:old"}}
YAML
done
# dq_variant ARCH VARIANT IMAGE [ARGS...]: the dry run plans VARIANT, would push IMAGE and patches dq-ARCH with it
dq_variant() { local a=$1 v=$2 img=$3 out; shift 3
  out=$(bash scripts/deploy-quantizer.sh "$a" --registry r.example:5000 --tag t1 -n "$NS" "$@" --dry-run 2>&1) || { echo "$out"; return 1; }
  grep -qF "dry run: would build and push $img (variant $v for $a: scripts/images/build.sh --only worker --variant $v --tag t1 --push r.example:5000)" <<<"$out" \
    || { echo "no plan line for $v / $img: $out"; return 1; }
  grep -qF "GPUProfile $NS/dq-${a//_/-}: quantization.images.GPTQ registry.example.com/flexinfer/worker:old -> $img (server-side dry run" <<<"$out" \
    || { echo "no patch line for $img: $out"; return 1; }
  [ "$(kubectl -n "$NS" get gpuprofile "dq-${a//_/-}" -o jsonpath='{.spec.quantization.images.GPTQ}')" = registry.example.com/flexinfer/worker:old ]; }
t "deploy-quantizer gfx1100 -> worker variant rocm-gfx1100 (dry run)" dq_variant gfx1100 rocm-gfx1100 r.example:5000/flexinfer/worker:t1-rocm-gfx1100
t "deploy-quantizer gfx906 -> worker variant rocm-gfx906 (dry run)" dq_variant gfx906 rocm-gfx906 r.example:5000/flexinfer/worker:t1-rocm-gfx906
t "deploy-quantizer sm_90 -> worker variant cuda (dry run)" dq_variant sm_90 cuda r.example:5000/flexinfer/worker:t1-cuda
t "deploy-quantizer --variant cpu -> the plain worker image (dry run)" dq_variant gfx1100 cpu r.example:5000/flexinfer/worker:t1 --variant cpu
if [ -n "${TESTENV_REGISTRY:-}" ]; then
  # The real thing: build (cached) and push the worker image to the local registry, patch the profile.
  t "deploy-quantizer pushes the worker image and pins the GPUProfile to its digest" bash -c "set -e
    bash scripts/deploy-quantizer.sh '$DQ_ARCH' --variant cpu --registry '$TESTENV_REGISTRY' --tag dq-$RUN_ID -n '$NS' >/dev/null 2>'$T/dq.err' \
      || { cat '$T/dq.err'; exit 1; }
    img=\$(kubectl -n '$NS' get gpuprofile dq -o jsonpath='{.spec.quantization.images.GPTQ}')
    d=\$(skopeo inspect --tls-verify=false 'docker://$TESTENV_REGISTRY/flexinfer/worker:dq-$RUN_ID' | python3 -c 'import json,sys; print(json.load(sys.stdin)[\"Digest\"])')
    [ \"\$img\" = '$TESTENV_REGISTRY/flexinfer/worker:dq-$RUN_ID'@\$d ] || { echo \"profile has \$img, registry digest \$d\"; exit 1; }"
else
  fail "deploy-quantizer push" "TESTENV_REGISTRY is not set (start the testenv in cluster mode)"
fi

echo "== live: helm uninstall"
t "helm uninstall keeps CRDs and custom resources" bash -c "set -e
  '$HELM' uninstall '$REL' -n '$NS' --wait >/dev/null
  kubectl get crd modelcaches.ai.flexinfer models.ai.flexinfer gpuprofiles.ai.flexinfer >/dev/null
  kubectl -n '$NS' get modelcache upgrade-probe >/dev/null
  ! kubectl -n '$NS' get deploy '$DEP' >/dev/null 2>&1
  ! kubectl get clusterrole '$DEP' >/dev/null 2>&1
  ! kubectl get validatingadmissionpolicy '$REL-flexinfer-promotion-gate' >/dev/null 2>&1"

echo
[ "$FAIL" = 0 ] || printf 'failed: %s\n' "${FAILED[@]}"
echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
