#!/usr/bin/env bash
# The REAL node of the local cluster (kubelet + containerd + runc), started by ../up.sh in cluster mode.
#   node/up.sh runtime W   - host bridge + CNI config, OCI registry, containerd, the local images
#   node/up.sh kubelet W   - kubelet registering node `localhost`, its labels/taint/GPU resources; waits Ready
# Everything lives under W/node (W = TESTENV_DIR); processes are appended to W/pids ("PID NAME"), so
# ../down.sh stops them; node/down.sh undoes what they change on the host. Writes W/node/env.
set -euo pipefail
PHASE=${1:?runtime|kubelet}; W=${2:?TESTENV_DIR}; BIN=${TESTENV_BIN:?}
HERE=$(cd "$(dirname "$0")" && pwd); N=$W/node; L=$W/logs; P=$W/pki; SOCK=$N/containerd/containerd.sock
mkdir -p "$N" "$L"
die() { echo "testenv node: $*" >&2; exit 1; }
start() { local n=$1; shift; nohup "$@" >"$L/$n.log" 2>&1 & echo "$! $n" >> "$W/pids"; }
port() { python3 -c 'import socket,sys;s=socket.socket();s.bind((sys.argv[1],0));print(s.getsockname()[1])' "$1"; }
# shellcheck source=/dev/null
[ -f "$N/vars" ] && . "$N/vars"
# Sysctls the kubelet (and a gateway bridge) may set; node/down.sh puts the recorded values back.
SYSCTLS="vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys
 kernel.keys.root_maxbytes net.ipv4.ip_forward net.ipv6.conf.all.forwarding"
# Host paths the kubelet/containerd/CNI create outside W even when configured to use W.
HOSTDIRS="/var/lib/kubelet /var/lib/kubelet/device-plugins /var/log/containers /var/lib/cni /var/lib/cni/results /run/netns
 /run/containerd /run/containerd/s /run/containerd/fifo /run/containerd/runc"

# Another live testenv with a real node (its bridge carries its W as alias); prints its W.
live_peer() { local b a; for b in /sys/class/net/fitenv*; do [ -e "$b" ] || continue
    a=$(cat "$b/ifalias" 2>/dev/null || true)
    [ -n "$a" ] && [ "$a" != "$W" ] && [ -f "$a/node/host.orig" ] && { echo "$a"; return 0; }; done; return 1; }

runtime() {
  for t in containerd containerd-shim-runc-v2 runc ctr ip iptables /usr/lib/cni/bridge /usr/lib/cni/host-local /usr/bin/docker-registry; do
    command -v "$t" >/dev/null || die "$t is missing (run scripts/install-deps.sh)"; done
  [ "$(id -u)" = 0 ] || die "the real node needs root (TESTENV_REAL_NODE=0 to skip it)"
  [ ${#SOCK} -le 90 ] || die "TESTENV_DIR $W is too long for containerd's unix sockets (${#SOCK} > 90 chars): use a shorter one"
  # 1. What the host looks like before us. A peer that is still running recorded the true originals.
  local peer; if peer=$(live_peer); then cp "$peer/node/host.orig" "$N/host.orig"; else
    { for s in $SYSCTLS; do echo "sysctl $s $(sysctl -n "$s" 2>/dev/null || echo -)"; done
      for d in $HOSTDIRS; do [ -e "$d" ] && echo "dir $d"; done
      for ipt in iptables ip6tables; do for t in filter nat mangle; do
        "$ipt" -w -t "$t" -S 2>/dev/null | awk -v i="$ipt" -v t="$t" '$1=="-N" && $2 ~ /^KUBE-/ {print "chain", i, t, $2}'; done; done
    } > "$N/host.orig.tmp"; mv "$N/host.orig.tmp" "$N/host.orig"; fi
  # 2. The pod network: a bridge of our own (fitenvI, I = first free index, the name is the lock), host side
  #    10.200.I.1/24. Pods get 10.200.I.x with no default route: they reach the host only on the bridge IP.
  local i br=""; for b in /sys/class/net/fitenv*; do [ -e "$b" ] || continue   # drop bridges of removed testenvs
    a=$(cat "$b/ifalias" 2>/dev/null || true); [ -n "$a" ] && [ ! -d "$a" ] && { ip link del "$(basename "$b")" 2>/dev/null || true; }; done
  for i in $(seq 1 250); do   # skip subnets the host already routes somewhere (other than by its default route)
    [ -z "$(ip -4 route show to match "10.200.$i.1" | grep -v '^default')" ] || continue
    ip link add "fitenv$i" type bridge 2>/dev/null && { br=fitenv$i; break; }; done
  [ -n "$br" ] || die "no free bridge name fitenv1..250"
  echo "$br" > "$N/bridge"; ip link set "$br" alias "$W"
  local ip=10.200.$i.1; echo 1 > "/proc/sys/net/ipv6/conf/$br/disable_ipv6" 2>/dev/null || true
  ip addr add "$ip/24" dev "$br"; ip link set "$br" up
  mkdir -p "$N/cni/net.d" "$N/cni/ipam"
  cat > "$N/cni/net.d/10-$br.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "$br",
 "plugins": [{"type": "bridge", "bridge": "$br", "isGateway": false, "ipMasq": false, "hairpinMode": false,
              "ipam": {"type": "host-local", "dataDir": "$N/cni/ipam",
                       "ranges": [[{"subnet": "10.200.$i.0/24", "gateway": "$ip", "rangeStart": "10.200.$i.10"}]]}}]}
EOF
  # 3. A real OCI registry on the bridge IP: reachable from the host and from pods, plain http.
  local rp; rp=$(port "$ip"); mkdir -p "$N/registry"
  printf 'version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: false\nstorage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\nhttp:\n  addr: %s\n' \
    "$N/registry/storage" "$ip:$rp" > "$N/registry/config.yml"
  start registry /usr/bin/docker-registry serve "$N/registry/config.yml"
  # 4. containerd: root/state/socket/runc root under W; no iptables; pulls from the registry over http.
  mkdir -p "$N/containerd/certs.d/$ip:$rp"
  printf 'server = "http://%s"\n\n[host."http://%s"]\n  capabilities = ["pull", "resolve", "push"]\n' "$ip:$rp" "$ip:$rp" \
    > "$N/containerd/certs.d/$ip:$rp/hosts.toml"
  cat > "$N/containerd/config.toml" <<EOF
version = 2
root = "$N/containerd/root"
state = "$N/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
[debug]
  address = "$N/containerd/debug.sock"
  level = "info"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$N/containerd/opt"
[plugins."io.containerd.runtime.v1.linux"]
  runtime_root = "$N/containerd/runc-v1"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:local"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_tcp_service = true
  enable_selinux = false
  disable_apparmor = true
  # No CAP_SYS_RESOURCE here: without this runc fails every sandbox ("can't get final child's PID from pipe").
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$N/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$N/cni/net.d"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$N/containerd/certs.d"
EOF
  # Network rule: pulls may only go to our registry. Any other registry goes to a dead loopback proxy.
  start containerd env HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9 \
    https_proxy=http://127.0.0.1:9 NO_PROXY="10.200.$i.0/24,127.0.0.1,localhost" no_proxy="10.200.$i.0/24,127.0.0.1,localhost" \
    containerd --config "$N/containerd/config.toml"
  printf 'BR=%s\nHOST_IP=%s\nREGISTRY=%s\n' "$br" "$ip" "$ip:$rp" > "$N/vars"
  local imgs ok=""; imgs=$(bash "$HERE/images.sh")
  for _ in $(seq 1 150); do ctr --address "$SOCK" version >/dev/null 2>&1 && { ok=1; break; }; sleep 0.1; done
  [ -n "$ok" ] || die "containerd did not start (log: $L/containerd.log)"
  for img in pause busybox; do ctr --address "$SOCK" -n k8s.io images import "$imgs/$img.tar" >/dev/null \
    || die "importing $imgs/$img.tar failed"; done
  ok=""; for _ in $(seq 1 100); do curl -fs --max-time 1 "http://$ip:$rp/v2/" >/dev/null 2>&1 && { ok=1; break; }; sleep 0.1; done
  [ -n "$ok" ] || die "registry did not start on $ip:$rp (log: $L/registry.log)"
}

kubelet() {
  [ -x "$BIN/kubelet" ] || die "missing $BIN/kubelet (scripts/testenv/build-bins.sh builds it)"
  : "${BR:?node/up.sh runtime first}"; local server kc=$N/kubelet.kubeconfig kp hp
  server=$(kubectl --kubeconfig="$W/kubeconfig" config view -o jsonpath='{.clusters[0].cluster.server}')
  kubectl config --kubeconfig="$kc" set-cluster testenv --server="$server" --certificate-authority="$P/ca.crt" --embed-certs=true >/dev/null
  kubectl config --kubeconfig="$kc" set-credentials kubelet --client-certificate="$P/kubelet-client.crt" --client-key="$P/kubelet-client.key" --embed-certs=true >/dev/null
  kubectl config --kubeconfig="$kc" set-context testenv --cluster=testenv --user=kubelet >/dev/null
  kubectl config --kubeconfig="$kc" use-context testenv >/dev/null
  kp=$(port 127.0.0.1); hp=$(port 127.0.0.1); mkdir -p "$N/kubelet" "$N/pod-logs"
  # Pods' cgroups go under /$BR (not /kubepods), so two testenvs' kubelets don't clean up each other's pods.
  local h hs=(/sys/fs/cgroup/*/); [ -f /sys/fs/cgroup/cgroup.controllers ] && hs=(/sys/fs/cgroup/)   # v1/hybrid or v2
  for h in "${hs[@]}"; do [ -d "$h$BR" ] || mkdir "$h$BR" 2>/dev/null || true
    if [ -f "${h}cpuset.cpus" ] && [ -z "$(cat "$h$BR/cpuset.cpus" 2>/dev/null)" ]; then
      cat "${h}cpuset.cpus" > "$h$BR/cpuset.cpus"; cat "${h}cpuset.mems" > "$h$BR/cpuset.mems"; fi; done
  cat > "$N/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: $kp
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $hp
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $P/ca.crt}
authorization: {mode: AlwaysAllow}
tlsCertFile: $P/kubelet-serving.crt
tlsPrivateKeyFile: $P/kubelet-serving.key
cgroupDriver: cgroupfs
cgroupRoot: /$BR
containerRuntimeEndpoint: unix://$SOCK
imageServiceEndpoint: unix://$SOCK
failSwapOn: false
failCgroupV1: false
makeIPTablesUtilChains: false
podLogsDir: $N/pod-logs
volumePluginDir: $N/kubelet/volume-plugins
resolvConf: ""
rotateCertificates: false
serverTLSBootstrap: false
registerNode: true
registerWithTaints:
- {key: flexinfer.ai/testenv-node, value: real, effect: NoSchedule}
nodeStatusReportFrequency: 10s
syncFrequency: 10s
kubeAPIQPS: 50
kubeAPIBurst: 100
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# Absolute disk thresholds: a percentage of a large shared host disk (2 % of 252 GB is 5 GB) put the
# test node under DiskPressure while gigabytes were still free, and evicted the controller mid-test.
evictionHard: {memory.available: "100Mi", nodefs.available: "512Mi", imagefs.available: "512Mi"}
maxPods: 20
EOF
  local t0 t1; t0=$(date +%s.%N)
  start kubelet "$BIN/kubelet" --config="$N/kubelet-config.yaml" --kubeconfig="$kc" --root-dir="$N/kubelet" \
    --cert-dir="$N/kubelet/pki" --hostname-override=localhost --node-ip="$HOST_IP" \
    --node-labels=flexinfer.ai/testenv-node=real,flexinfer.ai/gpu.arch=gfx1100 -v=2
  local kpid=$! K=(kubectl --kubeconfig="$W/kubeconfig") ok=""
  for _ in $(seq 1 300); do "${K[@]}" get node localhost >/dev/null 2>&1 && { ok=1; break; }
    kill -0 "$kpid" 2>/dev/null || break; sleep 0.1; done
  [ -n "$ok" ] || die "node localhost did not register: kubelet $(kill -0 "$kpid" 2>/dev/null && echo "still starting after 30 s" || echo exited) (log: $L/kubelet.log):"$'\n'"$(tail -n 15 "$L/kubelet.log")"
  # Extended resources the documented way: PATCH the node status (the kubelet keeps them).
  "${K[@]}" patch node localhost --subresource=status --type=json -p '[
    {"op":"add","path":"/status/capacity/amd.com~1gpu","value":"1"},
    {"op":"add","path":"/status/capacity/nvidia.com~1gpu","value":"1"},
    {"op":"add","path":"/status/allocatable/amd.com~1gpu","value":"1"},
    {"op":"add","path":"/status/allocatable/nvidia.com~1gpu","value":"1"}]' >/dev/null
  "${K[@]}" wait --for=condition=Ready node/localhost --timeout=60s >/dev/null 2>&1 \
    || die "node localhost not Ready (log: $L/kubelet.log, containerd: $L/containerd.log)"$'\n'"$(tail -n 15 "$L/kubelet.log")"
  t1=$(date +%s.%N)
  [ "$("${K[@]}" get node localhost -o jsonpath='{.status.allocatable.amd\.com/gpu}')" = 1 ] \
    || die "node localhost lost its amd.com/gpu (log: $L/kubelet.log)"
  python3 -c "print('node localhost Ready %.2f s after the kubelet started' % ($t1 - $t0))" > "$L/node-ready.txt"
  echo "TESTENV_NODE=localhost TESTENV_HOST_IP=$HOST_IP TESTENV_REGISTRY=$REGISTRY TESTENV_CONTAINERD_ADDRESS=$SOCK" > "$N/env"
}

"$PHASE"
