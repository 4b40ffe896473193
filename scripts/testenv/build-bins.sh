#!/usr/bin/env bash
set -euo pipefail
K8S_VERSION=${K8S_VERSION:-v1.34.4}; ETCD_VERSION=${ETCD_VERSION:-v3.6.4}   # envtest pairs 1.34→3.6.4, 1.35→3.6.6, 1.36→3.6.8
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}; HELM_VERSION=${HELM_VERSION:-v3.22.0}; KUBECONFORM_VERSION=${KUBECONFORM_VERSION:-v0.7.0}
HERE=$(cd "$(dirname "$0")" && pwd); BIN=${TESTENV_BIN:-$HOME/.cache/testenv/$K8S_VERSION/bin}
# Name the step that failed and what to try, instead of a bare Go error.
STEP="setup"; HINT=""
step() { STEP=$1; HINT=$2; echo "testenv: $STEP" >&2; }
trap 'rc=$?; [ $rc -ne 0 ] && echo "testenv build FAILED at step: $STEP (exit $rc). Try: $HINT" >&2' EXIT
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -trimpath"
MINOR=$(echo "$K8S_VERSION" | cut -d. -f2); W=$(mktemp -d); mkdir -p "$BIN"
trap 'rc=$?; rm -rf "$W"; [ $rc -ne 0 ] && echo "testenv build FAILED at step: $STEP (exit $rc). Try: $HINT" >&2' EXIT
command -v go >/dev/null || { STEP="find go"; HINT="install Go >= 1.24 (the module proxy must be reachable)"; exit 1; }
gomod_path() { go mod download -json "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])'; }
if [ ! -x "$BIN/kube-apiserver" ] || [ ! -x "$BIN/kube-scheduler" ] || [ ! -x "$BIN/kubelet" ]; then
  # One `go build` for the control plane and the kubelet: their shared packages compile once.
  step "build kube-apiserver/controller-manager/scheduler/kubelet $K8S_VERSION" "check the Go module proxy is reachable (GOPROXY=$(go env GOPROXY)); if 'go mod tidy' fails, replace it with 'go build -mod=mod'; a cold build needs ~4 GB RAM and ~10-20 min on 2 cores"
  mkdir "$W/k8s"; cd "$W/k8s"
  UP=$(gomod_path "k8s.io/kubernetes@$K8S_VERSION"); STG="v0.${K8S_VERSION#v1.}"     # v1.34.4 -> v0.34.4
  { echo "module local/k8s-bins"; echo
    grep -m1 -E '^go [0-9]' "$UP"; grep -E '^godebug ' "$UP" || true; echo
    echo "require k8s.io/kubernetes $K8S_VERSION"; echo; echo "replace ("
    sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/.*#\1#p' "$UP" |
      while read -r m; do echo "	$m => $m $STG"; done
    echo ")"; echo; echo "tool ("
    for c in kube-apiserver kube-controller-manager kube-scheduler kubelet; do echo "	k8s.io/kubernetes/cmd/$c"; done
    echo ")"; } > go.mod
  go mod tidy                        # fallback if tidy trips on something: skip it and use `go build -mod=mod`
  LD="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    LD+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$MINOR -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  go build -ldflags "$LD" -o "$BIN/" k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet
fi
if [ ! -x "$BIN/etcd" ]; then   # server/v3 IS a main package (server/main.go) but its go.mod has replaces -> no `go install @v`
  step "build etcd $ETCD_VERSION" "apt-get install etcd-server and copy /usr/bin/etcd to $BIN/etcd"
  mkdir "$W/etcd"; cd "$W/etcd"
  printf 'module local/etcd-bin\n\ngo 1.24.0\n\nrequire go.etcd.io/etcd/server/v3 %s\n\ntool go.etcd.io/etcd/server/v3\n' "$ETCD_VERSION" > go.mod
  go mod tidy && go build -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
fi
step "build kwok $KWOK_VERSION, kubeconform, helm $HELM_VERSION" "check the module proxy; set KWOK_VERSION/HELM_VERSION to a version 'go list -m -versions' shows"
[ -x "$BIN/kwok" ] || GOBIN="$BIN" go install -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
[ -x "$BIN/kubeconform" ] || GOBIN="$BIN" go install -ldflags "-s -w" "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION"
[ -x "$BIN/helm" ] || GOBIN="$BIN" go install -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION \
  -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$MINOR \
  -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$MINOR" \
  "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
step "assemble kwok stages" "run 'go mod download sigs.k8s.io/kwok@$KWOK_VERSION'"
GOFLAGS= go mod download "sigs.k8s.io/kwok@$KWOK_VERSION" >/dev/null 2>&1 || true
KS=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage   # stage YAMLs ship inside the kwok module
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
         pod/fast/pod-ready.yaml pod/fast/pod-delete.yaml; do cat "$KS/$f"; echo "---"; done > "$BIN/kwok-stages.yaml"
cat "$HERE/kwok-job-stages.yaml" >> "$BIN/kwok-stages.yaml"
step "verify binaries" "delete $BIN and rebuild"
"$BIN/kube-apiserver" --version; "$BIN/etcd" --version | sed -n 1p; "$BIN/helm" version --short
