#!/usr/bin/env bash
# Undo what the real node (node/up.sh) did on the host. Called by ../down.sh in two steps:
#   node/down.sh pods W    - stop the kubelet, kill the pods' processes and their containerd shims
#   node/down.sh host W    - after all processes are gone: mounts, bridge, cgroups, CNI cache, and, when no
#                            other testenv's node is still running, sysctls, KUBE-* iptables chains, host dirs
# Safe to run twice and after a half-finished node/up.sh: every step checks what is there.
set -uo pipefail
STEP=${1:?pods|host}; W=${2:?TESTENV_DIR}; N=$W/node; SOCK=$N/containerd/containerd.sock
[ -d "$N" ] || exit 0
BR=$(cat "$N/bridge" 2>/dev/null || true)
say() { echo "testenv node: $*"; }
# PIDs of processes whose command line contains all the given words (checked in /proc, so no reuse).
pids_with() { local f p c w ok; for f in $(grep -lsaF -- "$1" /proc/[0-9]*/cmdline); do p=${f#/proc/}; p=${p%/cmdline}
    [ "$p" = $$ ] && continue; c=$(tr '\0' ' ' 2>/dev/null < "$f") || continue
    ok=1; for w in "$@"; do [[ "$c" == *"$w"* ]] || { ok=0; break; }; done
    [ $ok = 1 ] && echo "$p"; done; }
# SIGTERM, up to $1 seconds, SIGKILL.
stop() { local t=$1; shift; [ $# -gt 0 ] || return 0; kill -TERM "$@" 2>/dev/null
  for _ in $(seq 1 $((t * 10))); do kill -0 "$@" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$@" 2>/dev/null; sleep 0.2; }
cg_hier() { if [ -f /sys/fs/cgroup/cgroup.controllers ]; then echo /sys/fs/cgroup/; else ls -d /sys/fs/cgroup/*/; fi; }
cg_procs() { [ -n "$BR" ] || return 0; local h; for h in $(cg_hier); do [ -d "$h$BR" ] && find "$h$BR" -name cgroup.procs -exec cat {} + 2>/dev/null; done | sort -u; }

pods() {
  # The kubelet first, so it does not restart what we stop.
  local k; k=$(pids_with "$N/kubelet-config.yaml"); [ -n "$k" ] && { stop 5 $k; say "stopped kubelet ($k)"; }
  # Every process in the pods' cgroups (pause + containers), then the shims of this containerd.
  local ps s; for _ in 1 2 3; do ps=$(cg_procs); [ -n "$ps" ] || break; kill -KILL $ps 2>/dev/null; sleep 0.2; done
  [ -n "$(cg_procs)" ] && say "WARNING: processes left in the pods' cgroups: $(cg_procs | tr '\n' ' ')"
  s=$(pids_with "$SOCK" containerd-shim "-address $SOCK ")
  if [ -n "$s" ]; then
    local p id; for p in $s; do   # the shim's socket is /run/containerd/s/sha256(address/namespace/id)
      id=$(tr '\0' '\n' < "/proc/$p/cmdline" 2>/dev/null | sed -n '/^-id$/{n;p;q}')
      [ -n "$id" ] && echo "/run/containerd/s/$(printf '%s' "$SOCK/k8s.io/$id" | sha256sum | cut -d' ' -f1)" >> "$N/shim-sockets"; done
    kill -KILL $s 2>/dev/null; sleep 0.2; say "killed $(echo $s | wc -w) containerd shim(s)"; fi
}

restore_host() {   # host-wide changes: only the last testenv node on this host puts them back
  local b a; for b in /sys/class/net/fitenv*; do [ -e "$b" ] || continue; a=$(cat "$b/ifalias" 2>/dev/null || true)
    if [ -n "$a" ] && [ "$a" != "$W" ] && [ -d "$a/node" ] && [ -n "$(pids_with "$a/node/kubelet-config.yaml")$(pids_with "$a/node/containerd/config.toml")" ]; then
      say "another testenv node ($a) still runs: leaving sysctls, iptables and host dirs to it"; return 0; fi; done
  [ -f "$N/host.orig" ] || return 0
  local kind x y z v
  while read -r kind x y z; do case $kind in
    sysctl) [ "$y" = - ] && continue; v=$(sysctl -n "$x" 2>/dev/null) || continue
            [ "$v" = "$y" ] || { sysctl -qw "$x=$y" && say "restored $x=$y (was $v)"; } ;;
  esac; done < "$N/host.orig"
  # KUBE-* chains that were not there before (the kubelet runs with makeIPTablesUtilChains=false, but be sure).
  local ipt t c r
  for ipt in iptables ip6tables; do command -v $ipt >/dev/null || continue; for t in filter nat mangle; do
    for c in $($ipt -w -t $t -S 2>/dev/null | awk '$1=="-N" && $2 ~ /^KUBE-/ {print $2}'); do
      grep -qx "chain $ipt $t $c" "$N/host.orig" && continue
      $ipt -w -t $t -S 2>/dev/null | grep -E -- "-j $c( |\$)" | grep -v "^-A $c " | while read -r _ r; do
        eval "$ipt -w -t $t -D $r" 2>/dev/null; done
      $ipt -w -t $t -F "$c" 2>/dev/null; $ipt -w -t $t -X "$c" 2>/dev/null && say "removed $ipt -t $t $c"; done; done; done
  # Host dirs created by the kubelet/containerd/CNI despite their W configuration.
  local d
  for d in /var/lib/kubelet/device-plugins /var/lib/kubelet /var/log/containers /var/lib/cni/results /var/lib/cni /run/netns \
           /run/containerd/s /run/containerd/fifo /run/containerd/runc /run/containerd; do
    [ -d "$d" ] || continue; grep -qx "dir $d" "$N/host.orig" && continue
    case $d in /var/lib/kubelet/device-plugins) rm -f "$d/kubelet.sock" "$d/kubelet_internal_checkpoint" "$d/DEPRECATION";; esac
    rmdir "$d" 2>/dev/null && say "removed $d"; done
}

host() {
  # Container log symlinks in /var/log/containers that point into W, the CNI result cache of our network.
  local f; for f in /var/log/containers/*; do [ -L "$f" ] && [[ "$(readlink "$f")" == "$W"/* ]] && rm -f "$f"; done
  if [ -n "$BR" ]; then local r id; for r in /var/lib/cni/results/"$BR"-*; do [ -e "$r" ] || continue
      id=${r#/var/lib/cni/results/"$BR"-}; id=${id%-*}; rm -f "$r" /var/lib/cni/results/cni-loopback-"$id"-lo; done; fi
  [ -f "$N/shim-sockets" ] && xargs -r rm -f < "$N/shim-sockets"
  # Mounts under W (overlay rootfs, shm, netns, the kubelet's bind mount of its root dir), deepest first.
  local m left; for _ in 1 2 3; do
    for m in $(awk -v w="$W/" 'index($5, w) == 1 || $5 == substr(w, 1, length(w) - 1) {print $5}' /proc/self/mountinfo | sort -r); do
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done
    left=$(awk -v w="$W/" 'index($5, w) == 1' /proc/self/mountinfo | wc -l); [ "$left" = 0 ] && break; sleep 0.3; done
  [ "$left" = 0 ] || say "WARNING: $left mount(s) left under $W"
  # The bridge (only ours: its alias is W) and the pods' cgroups, deepest first, only if empty.
  if [ -n "$BR" ] && [ -e "/sys/class/net/$BR" ] && [ "$(cat "/sys/class/net/$BR/ifalias" 2>/dev/null)" = "$W" ]; then
    ip link del "$BR" && say "removed bridge $BR"; fi
  if [ -n "$BR" ]; then local h; for h in $(cg_hier); do [ -d "$h$BR" ] || continue
      find "$h$BR" -depth -type d -exec rmdir {} + 2>/dev/null; [ -d "$h$BR" ] && say "WARNING: cgroup $h$BR not empty"; done; fi
  restore_host
  # Nothing of ours may remain mounted when ../down.sh removes W: rm -rf would go through a bind mount.
  [ "$left" = 0 ]
}

"$STEP"
