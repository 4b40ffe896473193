#!/usr/bin/env bash
# Install what the test suite needs on a fresh Debian machine (idempotent):
# promtool (Debian `prometheus`), a real OCI registry (Debian `docker-registry`), PyYAML,
# rustfmt/clippy, the local control-plane binaries and kubelet (built from Go modules, cached),
# and the runtime of the testenv's real node (containerd, runc, CNI plugins; see docs/dev/testenv.md).
set -euo pipefail
need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v docker-registry >/dev/null || [ -x /usr/bin/docker-registry ] || need+=(docker-registry)
python3 -c 'import yaml' 2>/dev/null || need+=(python3-yaml)
command -v openssl >/dev/null || need+=(openssl)
command -v curl >/dev/null || need+=(curl)
# The real node of the local cluster (scripts/testenv/node): containerd + runc, CNI plugins, iptables/iproute2,
# and what builds its images without a registry: gcc + static libc (pause), busybox-static, umoci, skopeo.
command -v containerd >/dev/null && command -v ctr >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] || need+=(containernetworking-plugins)
command -v iptables >/dev/null || need+=(iptables)
command -v ip >/dev/null || need+=(iproute2)
command -v gcc >/dev/null || need+=(gcc)
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || [ -f /usr/lib/libc.a ] || need+=(libc6-dev)
{ [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1; } || need+=(busybox-static)   # static: it goes into an image
command -v umoci >/dev/null || need+=(umoci)
command -v skopeo >/dev/null || need+=(skopeo)
# The images (scripts/images): buildah builds them daemonless, mmdebstrap makes their Debian base, jq reads
# the manifests.
command -v buildah >/dev/null || need+=(buildah)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v jq >/dev/null || need+=(jq)
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
  # A containerd service that the package just started (the testenv runs its own under TESTENV_DIR).
  if printf '%s\n' "${need[@]}" | grep -qx containerd; then
    (systemctl disable --now containerd || service containerd stop) >/dev/null 2>&1 || true; fi
fi
python3 -c 'import yaml' 2>/dev/null || pip install -q pyyaml
# The official `openai` Python client, for the proxy's client-compatibility test (cached by version).
OPENAI_PY_VERSION=3.51.0
OPENAI_VENV=$HOME/.cache/flexinfer/openai-venv-$OPENAI_PY_VERSION
if ! "$OPENAI_VENV/bin/python" -c 'import openai' >/dev/null 2>&1; then
  echo "install-deps: openai==$OPENAI_PY_VERSION into $OPENAI_VENV"
  rm -rf "$OPENAI_VENV"
  python3 -m venv "$OPENAI_VENV" && "$OPENAI_VENV/bin/pip" install -q "openai==$OPENAI_PY_VERSION" \
    || { echo "install-deps: cannot install openai==$OPENAI_PY_VERSION from PyPI" >&2; exit 1; }
fi
# The PyPI `compressed-tensors` library (with torch and transformers) for the FP8 consumer test, cached by version.
bash "$(dirname "$0")/fp8/make-venv.sh" >/dev/null \
  || { echo "install-deps: cannot install the compressed-tensors venv" >&2; exit 1; }
# GPTQModel (with torch and transformers) for the AWQ consumer test, cached by version.
bash "$(dirname "$0")/awq/make-venv.sh" >/dev/null \
  || { echo "install-deps: cannot install the AWQ (GPTQModel) venv" >&2; exit 1; }
# The PyPI `gguf` reader (llama.cpp's gguf-py, numpy only) for the GGUF reader test, cached by version.
bash "$(dirname "$0")/gguf/make-venv.sh" >/dev/null \
  || { echo "install-deps: cannot install the gguf reader venv" >&2; exit 1; }
rustup component add rustfmt clippy >/dev/null 2>&1 || true
# NVRTC for the CUDA kernel compile test (crates/flexinfer-quant/tests/kernels.rs loads it at run time): the
# PyPI wheel in a venv cached by version; nothing else of CUDA is installed (no driver, no GPU needed).
NVRTC_VERSION=${NVRTC_VERSION:-13.0.88}
nvrtc_dir="$HOME/.cache/flexinfer/nvrtc-$NVRTC_VERSION"
if ! compgen -G "$nvrtc_dir/lib/python3*/site-packages/nvidia/*/lib/libnvrtc.so*" >/dev/null; then
  echo "install-deps: pip install nvidia-cuda-nvrtc==$NVRTC_VERSION into $nvrtc_dir"
  rm -rf "$nvrtc_dir"
  python3 -m venv "$nvrtc_dir" \
    && "$nvrtc_dir/bin/pip" install -q --disable-pip-version-check "nvidia-cuda-nvrtc==$NVRTC_VERSION" \
    || { echo "install-deps: installing nvidia-cuda-nvrtc==$NVRTC_VERSION failed" >&2; exit 1; }
fi
bash "$(dirname "$0")/testenv/build-bins.sh"
