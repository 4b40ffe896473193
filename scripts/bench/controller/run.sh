#!/usr/bin/env bash
# Controller benchmark (not a test): N ModelCaches (default 500; download -> quantize -> publish,
# kwok-simulated pods) created at once on a fresh local cluster. Reports time until all are Ready,
# p50/p99 hand-off latency (previous phase's Job seen Complete -> next phase's Job seen created, both
# as observed by one watch client), controller peak RSS (VmHWM) and Kubernetes API requests per
# cache (the controller's own request counter, flexinfer_kube_api_requests_total).
# Usage: scripts/bench/controller/run.sh [N]   (BENCH_TIMEOUT seconds, default 1200; CONTROLLER_BIN: a
# prebuilt controller binary to measure instead of this checkout's, e.g. one built at an older commit).
# For thousands of caches the simulated cluster itself is the bottleneck (kube-controller-manager's Job
# controller talks to the API server at 20 requests/s by default, ~3 Jobs/s); raise it with
#   TESTENV_KCM_ARGS="--kube-api-qps=300 --kube-api-burst=600 --concurrent-job-syncs=50"
#   TESTENV_SCHEDULER_ARGS="--kube-api-qps=300 --kube-api-burst=600"
# and the script says which settings the run used.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd); cd "$ROOT"
N=${1:-500}
TIMEOUT=${BENCH_TIMEOUT:-1200}
export TESTENV_BIN=${TESTENV_BIN:-$HOME/.cache/testenv/v1.34.4/bin}
export PATH="$TESTENV_BIN:$PATH"
NS=bench
PROFILE=${BENCH_PROFILE:-debug}
TARGET=${CARGO_TARGET_DIR:-target}
if [ -n "${CONTROLLER_BIN:-}" ]; then BIN=$CONTROLLER_BIN
elif [ "$PROFILE" = release ]; then cargo build -q --release -j2 -p flexinfer-controller; BIN=$TARGET/release/flexinfer-controller
else cargo build -q -j2 -p flexinfer-controller; BIN=$TARGET/debug/flexinfer-controller; fi
W=$(mktemp -d)
bash scripts/testenv/up.sh cluster > "$W/env"; source "$W/env"
CTRL=""; WATCH=""
cleanup() {
  [ -n "$WATCH" ] && kill "$WATCH" 2>/dev/null || true
  [ -n "$CTRL" ] && kill "$CTRL" 2>/dev/null || true
  bash scripts/testenv/down.sh "$TESTENV_DIR" >/dev/null 2>&1 || true
  [ "${KEEP_LOGS:-0}" = 1 ] && echo "logs kept in $W" || rm -rf "$W"
}
trap cleanup EXIT
kubectl apply --server-side -k deploy/crds/ >/dev/null
kubectl wait --for=condition=Established crd/modelcaches.ai.flexinfer --timeout=60s >/dev/null
kubectl create ns "$NS" >/dev/null
kubectl apply -f - >/dev/null <<YAML
apiVersion: ai.flexinfer/v1alpha2
kind: GPUProfile
metadata: {name: gfx1100, namespace: $NS}
spec: {architecture: gfx1100, vendor: amd, quantization: {images: {GPTQ: example.com/worker:rocm}}}
YAML
python3 - "$N" "$NS" "$W" <<'PY'
import sys
n, ns, w = int(sys.argv[1]), sys.argv[2], sys.argv[3]
with open(f"{w}/pvs.yaml", "w") as f:
    for i in range(n):
        f.write(f"""---
apiVersion: v1
kind: PersistentVolume
metadata: {{name: bench-{i}}}
spec:
  capacity: {{storage: 100Gi}}
  accessModes: [ReadWriteOnce]
  storageClassName: ""
  hostPath: {{path: /tmp/bench}}
  claimRef: {{namespace: {ns}, name: c{i}-cache}}
""")
with open(f"{w}/caches.yaml", "w") as f:
    for i in range(n):
        f.write(f"""---
apiVersion: ai.flexinfer/v1alpha1
kind: ModelCache
metadata: {{name: c{i}, namespace: {ns}}}
spec:
  source: org/model-{i}
  quantization: {{format: GPTQ}}
  publish: {{ociRef: registry.local/models/c{i}}}
""")
PY
kubectl create -f "$W/pvs.yaml" >/dev/null
FLEXINFER_WORKER_IMAGE=example.com/worker:cpu FLEXINFER_WATCH_NAMESPACE=$NS FLEXINFER_LEADER_ELECT=false \
FLEXINFER_METRICS_ADDR=127.0.0.1:18090 FLEXINFER_HEALTH_ADDR=127.0.0.1:18091 RUST_LOG=${BENCH_RUST_LOG:-warn} \
  "$BIN" > "$W/controller.log" 2>&1 &
CTRL=$!
# A controller that cannot start (e.g. its metrics port is held by another run's controller) ends
# the run here: its figures would otherwise be read from that other process.
sleep 2
kill -0 "$CTRL" 2>/dev/null || { echo "the controller exited at start-up:" >&2; cat "$W/controller.log" >&2; exit 1; }
# One watch client stamps every Job event with its local receive time. A watch ends (the API server
# closes it, or kubectl gives up under load): it is started again without a listing (--watch-only),
# so the events of the gap are missing rather than stamped late, and each restart is counted.
python3 - "$NS" "$W/jobs.log" <<'PY' &
import subprocess, sys, time
ns, out = sys.argv[1], sys.argv[2]
with open(out, "w", buffering=1) as f:
    while True:
        p = subprocess.Popen(["kubectl", "get", "jobs", "-n", ns, "-w", "--watch-only", "--output-watch-events", "-o",
                              "jsonpath={.type} {.object.metadata.name} {.object.status.conditions[*].type}{\"\\n\"}"],
                             stdout=subprocess.PIPE, text=True)
        for line in p.stdout:
            f.write(f"{time.time():.3f} {line}")
        p.wait()
        f.write(f"{time.time():.3f} RESTART\n")
        time.sleep(1)
PY
WATCH=$!
until curl -fs http://127.0.0.1:18091/readyz >/dev/null 2>&1; do sleep 0.2; done
sleep 2
echo "simulated cluster: kube-controller-manager extra flags '${TESTENV_KCM_ARGS:-}', kube-scheduler '${TESTENV_SCHEDULER_ARGS:-}'"
echo "creating $N ModelCaches at once"
T0=$(date +%s.%N)
kubectl create -f "$W/caches.yaml" >/dev/null
T1=$(date +%s.%N)
# Ready caches as the API server has them (a listing of every cache: megabytes at thousands of caches).
api_ready() { kubectl get modelcache -n "$NS" -o jsonpath='{range .items[*]}{.status.phase}{"\n"}{end}' | grep -c '^Ready$' || true; }
# While the run goes, count from the controller's own phase series (its /metrics; the row changes only
# after the status write that made the cache Ready succeeded): listing every cache once a second (or
# every 30 s at thousands) was a load on the API server that the measured hand-offs shared. The end is
# confirmed by one listing from the API server.
metrics_ready() { curl -fs http://127.0.0.1:18090/metrics | grep -c '^flexinfer_modelcache_phase{.*phase="Ready"} 1$' || true; }
while :; do
  READY=$(metrics_ready)
  NOW=$(date +%s.%N)
  if [ "$READY" -ge "$N" ]; then
    READY=$(api_ready)
    if [ "$READY" -ge "$N" ]; then break; fi
  fi
  if python3 -c "import sys; sys.exit(0 if $NOW - $T0 > $TIMEOUT else 1)"; then READY=$(api_ready); echo "timeout: $READY/$N Ready (API server)"; break; fi
  # Above 1,000 caches say every 10 s how far the run is and the controller's resident memory now.
  if [ "$N" -gt 1000 ]; then
    printf '%5.0fs: %s of %s Ready, controller RSS %s\n' "$(python3 -c "print($NOW - $T0)")" "$READY" "$N" \
      "$(awk '/VmRSS/{printf "%.1f MiB", $2/1024}' /proc/$CTRL/status)"
    sleep 10
  else sleep 1; fi
done
TREADY=$(date +%s.%N)
sleep 3
RSS=$(awk '/VmHWM/{print $2}' /proc/$CTRL/status)
# Why Jobs were deleted or retried, if they were: the caches' retry counts and every event reason of the run
# (the controller's on the caches, and the cluster's own, e.g. nodes going NotReady under load).
RETRIED=$(kubectl get modelcache -n "$NS" -o jsonpath='{range .items[*]}{.status.retryCount}{"\n"}{end}' | grep -c '^[1-9]' || true)
echo "caches with a retry: $RETRIED"
echo "event reasons (all namespaces):"; kubectl get events -A -o jsonpath='{range .items[*]}{.reason}{"\n"}{end}' | sort | uniq -c | sort -rn | head -15
METRICS=$(curl -fs http://127.0.0.1:18090/metrics)
# What the API server spent its time on, by verb and resource (all clients: the controller, the
# kube-controller-manager's Job controller, the scheduler, kwok): requests and the summed handling time.
echo "API server requests by verb and resource (all clients; count, summed seconds), top 12 by time:"
kubectl get --raw /metrics | python3 -c '
import sys, re, collections
n, t = collections.Counter(), collections.Counter()
for l in sys.stdin:
    m = re.match(r"apiserver_request_(total|duration_seconds_sum)\{(.*)\} (\S+)$", l)
    if not m: continue
    lab = dict(re.findall(r"(\w+)=\"([^\"]*)\"", m.group(2)))
    if lab.get("verb") == "WATCH": continue
    k = lab.get("verb", "?") + " " + lab.get("resource", "?") + ("/" + lab["subresource"] if lab.get("subresource") else "")
    (n if m.group(1) == "total" else t)[k] += float(m.group(3))
for k, v in sorted(t.items(), key=lambda kv: -kv[1])[:12]:
    print(f"  {k:40s} {n[k]:9.0f} {v:9.1f}")
' || true
# Who used the two cores: CPU seconds (user + system) of each process of the simulated cluster and of the
# controller over the run, beside the wall time (a 2-core machine has 2 CPU seconds per second).
echo "CPU seconds over the run (wall $(python3 -c "print(round($TREADY - $T0))") s):"
for p in etcd kube-apiserver kube-controller-manager kube-scheduler kwok; do
  pid=$(pgrep -f "^$TESTENV_BIN/$p " | head -1 || true)
  [ -n "$pid" ] && awk -v n="$p" '{printf "  %-24s %8.1f\n", n, ($14+$15)/100}' "/proc/$pid/stat"
done
awk '{printf "  %-24s %8.1f\n", "flexinfer-controller", ($14+$15)/100}' "/proc/$CTRL/stat"
python3 - "$W/jobs.log" "$N" "$T0" "$T1" "$TREADY" "$RSS" "$READY" <<PY
import sys, collections
log, n, t0, t1, tready, rss, ready = sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:6]), int(sys.argv[6]), int(sys.argv[7])
added, done, restarts = {}, {}, 0
for line in open(log):
    parts = line.split()
    if len(parts) == 2 and parts[1] == "RESTART": restarts += 1
    if len(parts) < 3: continue
    ts, typ, name = float(parts[0]), parts[1], parts[2]
    conds = parts[3:]
    if typ == "ADDED": added.setdefault(name, ts)
    # SuccessCriteriaMet (then Complete) is what the job controller sets when the pod succeeded.
    if "SuccessCriteriaMet" in conds or "Complete" in conds: done.setdefault(name, ts)
order = ["download", "quantize", "publish"]
lat = []
for name, ts in done.items():
    cache, phase = name.rsplit("-", 1)
    if phase in order and order.index(phase) + 1 < len(order):
        nxt = f"{cache}-{order[order.index(phase)+1]}"
        if nxt in added: lat.append(added[nxt] - ts)
lat.sort()
q = lambda p: lat[min(len(lat)-1, int(p * len(lat)))] if lat else float("nan")
reqs = collections.Counter(); by_resource = collections.Counter()
for l in """$METRICS""".splitlines():
    if l.startswith("flexinfer_kube_api_requests_total{"):
        verb = l.split('verb="')[1].split('"')[0]; v = float(l.split()[-1]); reqs[verb] += v
        res = l.split('resource="')[1].split('"')[0] if 'resource="' in l else "?"
        by_resource[f"{verb} {res}"] += v
total = sum(reqs.values())
retries = {l.split('reason="')[1].split('"')[0]: float(l.split()[-1]) for l in """$METRICS""".splitlines()
           if l.startswith("flexinfer_reconcile_retries_total{") and 'controller="modelcache"' in l}
print(f"caches: {n} (Ready: {ready}), create took {t1-t0:.1f}s")
print(f"time until all Ready (from first create): {tready-t0:.1f}s")
print(f"hand-offs measured: {len(lat)} (the Job watch was restarted {restarts} times; events of its gaps are not counted); p50 {q(0.5)*1000:.0f} ms, p99 {q(0.99)*1000:.0f} ms, max {lat[-1]*1000 if lat else float('nan'):.0f} ms")
print(f"controller peak RSS (VmHWM): {rss/1024:.1f} MiB")
print(f"reconciles run again without failing (wasted conditional writes are 'conflict'): {retries}")
print(f"API requests: {total:.0f} total = {total/n:.1f} per cache; by verb: {dict(reqs)}")
if len(by_resource) > 1 or "?" not in str(list(by_resource)):
    print("by verb and resource: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(by_resource.items(), key=lambda kv: -kv[1])))
PY
