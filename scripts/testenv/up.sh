#!/usr/bin/env bash
set -euo pipefail                      # usage: TESTENV_BIN=… up.sh [api|cluster]; prints `export KUBECONFIG=… TESTENV_DIR=…`
# cluster mode also starts a REAL node `localhost` (kubelet + containerd, see node/up.sh and docs/dev/testenv.md)
# unless TESTENV_REAL_NODE=0, and then also prints TESTENV_NODE, TESTENV_HOST_IP, TESTENV_REGISTRY, TESTENV_CONTAINERD_ADDRESS.
# TESTENV_KCM_ARGS / TESTENV_SCHEDULER_ARGS: extra flags for kube-controller-manager / kube-scheduler (the
# controller benchmark raises their client QPS and Job workers so the simulated cluster is not the bottleneck).
MODE=${1:-cluster}; BIN=${TESTENV_BIN:?}; W=${TESTENV_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/testenv.XXXXXX")}
HERE=$(cd "$(dirname "$0")" && pwd); NODE=0; [ "$MODE" = cluster ] && [ "${TESTENV_REAL_NODE:-1}" != 0 ] && NODE=1
P=$W/pki; mkdir -p "$P" "$W/etcd" "$W/logs"; W=$(cd "$W" && pwd -P); P=$W/pki
# On failure: say where the logs are, stop what was started and undo the host changes, keep W/logs.
trap 'rc=$?; if [ $rc -ne 0 ]; then echo "testenv: up.sh failed (exit $rc); logs: $W/logs" >&2
  [ -n "${RUNTIME:-}" ] && { wait "$RUNTIME" 2>/dev/null || true; }
  TESTENV_KEEP_LOGS=1 bash "$HERE/down.sh" "$W" >&2 || true; fi' EXIT
for b in etcd kube-apiserver; do [ -x "$BIN/$b" ] || { echo "missing $BIN/$b" >&2; exit 1; }; done
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
EP=$(port); PP=$(port); AP=$(port); KP=$(port); SP=$(port); q() { "$@" >/dev/null 2>&1; }
q openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=testenv-ca -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" -keyout "$P/ca.key" -out "$P/ca.crt"
mkcert() { q openssl req -new -newkey rsa:2048 -nodes -subj "$2" -keyout "$P/$1.key" -out "$P/$1.csr"; printf '%b' "$3" > "$P/$1.ext"
  q openssl x509 -req -in "$P/$1.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -days 3650 -extfile "$P/$1.ext" -out "$P/$1.crt"; }
mkcert apiserver "/CN=kube-apiserver" "subjectAltName=IP:127.0.0.1,DNS:localhost,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
mkcert admin "/O=system:masters/CN=testenv-admin" "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
KUBELET_AUTH=(--authorization-mode=RBAC)
if [ $NODE = 1 ]; then   # the real node: kubelet client/serving certs, apiserver -> kubelet client cert
  CL="extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
  mkcert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$CL"
  mkcert kubelet-client "/O=system:nodes/CN=system:node:localhost" "$CL"
  mkcert kubelet-serving "/CN=localhost" "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
  KUBELET_AUTH=(--authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction
    --kubelet-client-certificate="$P/apiserver-kubelet-client.crt" --kubelet-client-key="$P/apiserver-kubelet-client.key"
    --kubelet-preferred-address-types=Hostname)   # the node `localhost` -> 127.0.0.1, where the kubelet listens
  bash "$HERE/node/up.sh" runtime "$W" >&2 & RUNTIME=$!   # bridge, registry, containerd: while the control plane starts
fi
q openssl genrsa -out "$P/sa.key" 2048; q openssl rsa -in "$P/sa.key" -pubout -out "$P/sa.pub"
KC=$W/kubeconfig
q kubectl config --kubeconfig="$KC" set-cluster testenv --server="https://127.0.0.1:$AP" --certificate-authority="$P/ca.crt" --embed-certs=true
q kubectl config --kubeconfig="$KC" set-credentials admin --client-certificate="$P/admin.crt" --client-key="$P/admin.key" --embed-certs=true
q kubectl config --kubeconfig="$KC" set-context testenv --cluster=testenv --user=admin
q kubectl config --kubeconfig="$KC" use-context testenv
start() { local n=$1; shift; nohup "$@" >"$W/logs/$n.log" 2>&1 & echo "$! $n" >> "$W/pids"; }
wait_for() { for _ in $(seq 1 $(( $2 * 5 ))); do curl -fsk --max-time 1 "$1" >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "timeout: $1 (logs: $W/logs)" >&2; return 1; }
FSYNC=(); grep -q unsafe-no-fsync <<<"$("$BIN/etcd" --help 2>&1)" && FSYNC=(--unsafe-no-fsync=true)
start etcd "$BIN/etcd" --name=testenv --data-dir="$W/etcd" --listen-client-urls="http://127.0.0.1:$EP" \
  --advertise-client-urls="http://127.0.0.1:$EP" --listen-peer-urls="http://127.0.0.1:$PP" \
  --initial-advertise-peer-urls="http://127.0.0.1:$PP" --initial-cluster="testenv=http://127.0.0.1:$PP" "${FSYNC[@]}"
wait_for "http://127.0.0.1:$EP/health" 30
start kube-apiserver "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$EP" --cert-dir="$P" \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$AP" \
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" --client-ca-file="$P/ca.crt" \
  "${KUBELET_AUTH[@]}" --allow-privileged=true --service-cluster-ip-range=10.96.0.0/16 \
  --service-account-issuer="https://127.0.0.1:$AP/" --service-account-key-file="$P/sa.pub" \
  --service-account-signing-key-file="$P/sa.key" --disable-admission-plugins=ServiceAccount
wait_for "https://127.0.0.1:$AP/readyz" 90      # anonymous /readyz is allowed by system:public-info-viewer
for _ in $(seq 1 100); do q kubectl --kubeconfig="$KC" get ns default && break; sleep 0.2; done
if [ "$MODE" = cluster ]; then
  for b in kube-controller-manager kube-scheduler kwok; do [ -x "$BIN/$b" ] || { echo "missing $BIN/$b" >&2; exit 1; }; done
  AUTHN=(--kubeconfig="$KC" --authentication-kubeconfig="$KC" --authorization-kubeconfig="$KC"
         --authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics --bind-address=127.0.0.1 --leader-elect=false)
  start kube-controller-manager "$BIN/kube-controller-manager" "${AUTHN[@]}" --secure-port="$KP" \
    --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" --flex-volume-plugin-dir="$W/flexvolume" --node-monitor-period=5s --node-monitor-grace-period=40s \
    ${TESTENV_KCM_ARGS:-}
  start kube-scheduler "$BIN/kube-scheduler" "${AUTHN[@]}" --secure-port="$SP" ${TESTENV_SCHEDULER_ARGS:-}
  start kwok "$BIN/kwok" --kubeconfig="$KC" --config="${KWOK_CONFIG:-$BIN/kwok-stages.yaml}" \
    --manage-all-nodes=false --manage-nodes-with-label-selector=type=kwok --cidr=10.244.0.1/16 --node-ip=10.250.0.1 --node-lease-duration-seconds=40
  wait_for "https://127.0.0.1:$KP/healthz" 60; wait_for "https://127.0.0.1:$SP/healthz" 60
  # Fake GPU nodes, one per architecture FlexInfer targets, plus a CPU node.
  node() { printf 'apiVersion: v1\nkind: Node\nmetadata:\n  name: %s\n  labels: {kubernetes.io/hostname: %s, kubernetes.io/os: linux, type: kwok%s}\nstatus:\n  allocatable: {cpu: "32", memory: 512Gi, pods: "110"%s}\n  capacity: {cpu: "32", memory: 512Gi, pods: "110"%s}\n' "$1" "$1" "$2" "$3" "$3" \
      | q kubectl --kubeconfig="$KC" apply -f -
    q kubectl --kubeconfig="$KC" wait --for=condition=Ready "node/$1" --timeout=60s || { echo "node $1 not Ready (logs: $W/logs)" >&2; exit 1; }; }
  node kwok-gfx1100 ", flexinfer.ai/gpu.arch: gfx1100" ", amd.com/gpu: \"8\""
  node kwok-gfx906 ", flexinfer.ai/gpu.arch: gfx906" ", amd.com/gpu: \"8\""
  node kwok-sm89 ", flexinfer.ai/gpu.arch: sm_89" ", nvidia.com/gpu: \"8\""
  node kwok-cpu "" ""
  # The real node: tainted flexinfer.ai/testenv-node=real:NoSchedule, so only pods that tolerate it run there.
  if [ $NODE = 1 ]; then wait "$RUNTIME"; bash "$HERE/node/up.sh" kubelet "$W" >&2; NODE_ENV=" $(cat "$W/node/env")"; fi
fi
echo "export KUBECONFIG=$KC TESTENV_DIR=$W${NODE_ENV:-}"
