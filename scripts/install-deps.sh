#!/usr/bin/env bash
# Install what the test suite needs on a fresh Debian machine (idempotent):
# promtool (Debian `prometheus`), a real OCI registry (Debian `docker-registry`), PyYAML,
# rustfmt/clippy, and the local control-plane binaries (built from Go modules, cached).
set -euo pipefail
need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v docker-registry >/dev/null || [ -x /usr/bin/docker-registry ] || need+=(docker-registry)
python3 -c 'import yaml' 2>/dev/null || need+=(python3-yaml)
command -v openssl >/dev/null || need+=(openssl)
command -v curl >/dev/null || need+=(curl)
command -v kubectl >/dev/null || { echo "install-deps: kubectl is not on PATH (it comes with the machine image; install it from your distribution)" >&2; exit 1; }
if [ ${#need[@]} -gt 0 ]; then
  echo "install-deps: apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
    || { echo "install-deps: apt-get install ${need[*]} failed" >&2; exit 1; }
  # The packages start system services we don't use; the tests start their own instances.
  for s in prometheus docker-registry prometheus-node-exporter; do
    (systemctl stop "$s" || service "$s" stop || pkill -x "$s") >/dev/null 2>&1 || true
  done
fi
python3 -c 'import yaml' 2>/dev/null || pip install -q pyyaml
rustup component add rustfmt clippy >/dev/null 2>&1 || true
bash "$(dirname "$0")/testenv/build-bins.sh"
