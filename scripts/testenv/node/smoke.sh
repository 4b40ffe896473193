#!/usr/bin/env bash
# Smoke test of the real node against a running testenv (source the output of up.sh cluster first):
# node and kwok nodes Ready; a pod with a locally loaded image runs to Succeeded and `kubectl logs`/`exec` work;
# a Job writes to a hostPath as uid 65532; the kubelet's readiness probe and the host reach a pod; a pod reaches
# the registry on TESTENV_HOST_IP; an image pushed there is pulled by the kubelet; load-image.sh; amd.com/gpu.
# Prints timings. Leaves nothing behind (namespace testenv-smoke is deleted).
set -euo pipefail
: "${KUBECONFIG:?source the output of up.sh}" "${TESTENV_REGISTRY:?the testenv has no real node}" "${TESTENV_DIR:?}"
K=(kubectl); NS=testenv-smoke; HERE=$(cd "$(dirname "$0")" && pwd)
now() { date +%s.%N; }
dt() { python3 -c "print('%.2f' % ($2 - $1))"; }
fail() { echo "smoke: FAIL: $*" >&2; "${K[@]}" -n $NS get pods -o wide >&2 || true; exit 1; }
ok() { echo "smoke: ok: $*"; }
"${K[@]}" wait --for=condition=Ready node/localhost node/kwok-gfx1100 node/kwok-gfx906 node/kwok-sm89 node/kwok-cpu --timeout=30s >/dev/null \
  || fail "nodes not Ready"
[ "$("${K[@]}" get node localhost -o jsonpath='{.spec.taints[?(@.key=="flexinfer.ai/testenv-node")].effect}')" = NoSchedule ] || fail "taint missing"
ok "node localhost and the kwok nodes are Ready; localhost is tainted"
"${K[@]}" delete ns $NS --ignore-not-found --wait=true >/dev/null; "${K[@]}" create ns $NS >/dev/null
trap '"${K[@]}" delete ns $NS --wait=false >/dev/null 2>&1 || true' EXIT
ON_NODE='nodeSelector: {flexinfer.ai/testenv-node: real}
  tolerations: [{key: flexinfer.ai/testenv-node, operator: Equal, value: real, effect: NoSchedule}]'
pod() {  # NAME IMAGE POLICY COMMAND [EXTRA-SPEC]
  printf 'apiVersion: v1\nkind: Pod\nmetadata: {name: %s}\nspec:\n  %s\n  restartPolicy: Never\n  terminationGracePeriodSeconds: 1\n  containers:\n  - name: c\n    image: %s\n    imagePullPolicy: %s\n    command: ["/bin/sh", "-c", %s]\n%s\n' \
    "$1" "$ON_NODE" "$2" "$3" "$(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$4")" "${5:-}" | "${K[@]}" -n $NS apply -f - >/dev/null; }
phase() { "${K[@]}" -n $NS get pod "$1" -o jsonpath='{.status.phase}' 2>/dev/null; }
wait_phase() { for _ in $(seq 1 ${3:-300}); do [ "$(phase "$1")" = "$2" ] && return 0; [ "$(phase "$1")" = Failed ] && break; sleep 0.1; done
  "${K[@]}" -n $NS describe pod "$1" >&2; fail "pod $1 not $2"; }

# 0. kwok still simulates the pods on its nodes (and only there).
printf 'apiVersion: v1\nkind: Pod\nmetadata: {name: sim}\nspec:\n  nodeSelector: {flexinfer.ai/gpu.arch: gfx906}\n  containers: [{name: c, image: not-pulled.invalid/x}]\n' \
  | "${K[@]}" -n $NS apply -f - >/dev/null
for _ in $(seq 1 100); do [ "$(phase sim)" = Running ] && break; sleep 0.1; done
[ "$(phase sim)" = Running ] && [ "$("${K[@]}" -n $NS get pod sim -o jsonpath='{.spec.nodeName}')" = kwok-gfx906 ] || fail "kwok did not run pod sim"
ok "kwok simulates a pod on kwok-gfx906"

# 1. A pod with the locally built busybox (imported by up.sh): create -> Succeeded, logs.
t0=$(now); pod hello localhost/busybox:local Never 'echo hello from $(hostname) uid=$(id -u)'
wait_phase hello Succeeded; t1=$(now)
[[ "$("${K[@]}" -n $NS logs hello)" == "hello from hello uid=0" ]] || fail "kubectl logs: $("${K[@]}" -n $NS logs hello)"
[ "$("${K[@]}" -n $NS get pod hello -o jsonpath='{.spec.nodeName}')" = localhost ] || fail "hello not on localhost"
ok "pod create -> Succeeded $(dt "$t0" "$t1") s; kubectl logs works"

# 2. A Job writing to a hostPath as uid 65532 (hostPath ignores fsGroup: the host dir must be writable).
D=$TESTENV_DIR/smoke-hostpath; mkdir -p "$D"; chmod 0777 "$D"
t0=$(now)
cat <<EOF | "${K[@]}" -n $NS apply -f - >/dev/null
apiVersion: batch/v1
kind: Job
metadata: {name: writer}
spec:
  backoffLimit: 0
  template:
    spec:
      nodeSelector: {flexinfer.ai/testenv-node: real}
      tolerations: [{key: flexinfer.ai/testenv-node, operator: Equal, value: real, effect: NoSchedule}]
      restartPolicy: Never
      securityContext: {runAsUser: 65532, runAsGroup: 65532, fsGroup: 65532}
      containers:
      - name: w
        image: localhost/busybox:local
        imagePullPolicy: Never
        resources: {requests: {cpu: 50m, memory: 32Mi}, limits: {cpu: 200m, memory: 64Mi}}
        command: ["/bin/sh", "-c", "id -u > /out/result.txt && echo written"]
        volumeMounts: [{name: out, mountPath: /out}]
      volumes: [{name: out, hostPath: {path: $D, type: Directory}}]
EOF
"${K[@]}" -n $NS wait --for=condition=Complete job/writer --timeout=60s >/dev/null || fail "job writer did not complete"; t1=$(now)
[ "$(cat "$D/result.txt")" = 65532 ] && [ "$(stat -c %u "$D/result.txt")" = 65532 ] || fail "hostPath file not written as 65532"
ok "Job with hostPath wrote $D/result.txt as uid 65532 in $(dt "$t0" "$t1") s"

# 3. Host <-> pod: an http server in a pod, a readiness probe (kubelet -> pod), curl from the host,
#    and kubectl exec.
pod web localhost/busybox:local Never 'mkdir -p /w && echo pong > /w/ping && exec httpd -f -p 8080 -h /w' \
'    readinessProbe: {httpGet: {path: /ping, port: 8080}, periodSeconds: 1}'
"${K[@]}" -n $NS wait --for=condition=Ready pod/web --timeout=60s >/dev/null || fail "web not Ready (readiness probe)"
IP=$("${K[@]}" -n $NS get pod web -o jsonpath='{.status.podIP}')
[ "$(curl -fs --max-time 5 "http://$IP:8080/ping")" = pong ] || fail "host cannot reach pod $IP"
[ "$("${K[@]}" -n $NS exec web -- cat /w/ping)" = pong ] || fail "kubectl exec"
ok "readiness probe, host -> pod ($IP:8080) and kubectl exec work"

# 4. Pod -> registry on the host (TESTENV_REGISTRY); pod -> anything else is unreachable (no default route).
pod reg localhost/busybox:local Never "wget -qO- http://$TESTENV_REGISTRY/v2/ && ! ip route | grep -q default && ! wget -T 2 -qO- http://10.96.0.1/ 2>/dev/null"
wait_phase reg Succeeded
ok "pod reaches the registry at $TESTENV_REGISTRY, and has no default route"

# 5. An image pushed to the registry is pulled by the kubelet (plain http).
skopeo copy --quiet --dest-tls-verify=false "docker-archive:$("$HERE/images.sh")/busybox.tar" \
  "docker://$TESTENV_REGISTRY/smoke/busybox:v1"
t0=$(now); pod pulled "$TESTENV_REGISTRY/smoke/busybox:v1" Always 'echo pulled'
wait_phase pulled Succeeded; t1=$(now)
[ "$("${K[@]}" -n $NS logs pulled)" = pulled ] || fail "logs of pulled"
ok "the kubelet pulled $TESTENV_REGISTRY/smoke/busybox:v1; create -> Succeeded $(dt "$t0" "$t1") s"

# 6. load-image.sh: an OCI archive loaded under a docker-style NAME runs with imagePullPolicy: Never.
T=$(mktemp -d); skopeo copy --quiet "docker-archive:$("$HERE/images.sh")/busybox.tar" "oci-archive:$T/img.tar:latest"
[ "$("$HERE/../load-image.sh" "$T/img.tar" flexinfer/smoke:dev)" = docker.io/flexinfer/smoke:dev ] || fail "load-image.sh"
rm -rf "$T"; pod loaded flexinfer/smoke:dev Never 'echo loaded'
wait_phase loaded Succeeded
ok "load-image.sh: an OCI archive loaded as flexinfer/smoke:dev ran with imagePullPolicy: Never"

# 7. Memory limits are enforced: a 32Mi container that allocates more is OOM-killed.
pod oom localhost/busybox:local Never 'head -c 200m /dev/zero | tail >/dev/null; echo survived' \
'    resources: {limits: {memory: 32Mi}}'
for _ in $(seq 1 300); do r=$("${K[@]}" -n $NS get pod oom -o jsonpath='{.status.containerStatuses[0].state.terminated.reason}' 2>/dev/null)
  [ -n "$r" ] && break; sleep 0.1; done
[ "$r" = OOMKilled ] || fail "pod oom: terminated reason '$r', expected OOMKilled"
ok "a 32Mi pod that allocates 200 MiB is OOMKilled"

# 8. Extended resources: a pod asking for amd.com/gpu and nvidia.com/gpu lands on localhost.
pod gpu localhost/busybox:local Never 'echo gpu' \
'    resources: {limits: {amd.com/gpu: "1", nvidia.com/gpu: "1"}}'
wait_phase gpu Succeeded
ok "a pod with amd.com/gpu: 1 and nvidia.com/gpu: 1 ran on localhost"
echo "smoke: all passed"
