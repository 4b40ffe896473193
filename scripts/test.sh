#!/usr/bin/env bash
# The whole test suite: format + lint, unit tests, integration tests against a real control plane
# (kube-apiserver + etcd + controller-manager + scheduler + kwok GPU nodes + one real kubelet/containerd
# node + an OCI registry), the real pipeline end to end (images built from build/*.Dockerfile, FlexInfer
# installed with Helm, Jobs running the worker image on the real node), chart/alert tests.
# Starts the control plane once and always tears it down.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
export TESTENV_BIN=${TESTENV_BIN:-$HOME/.cache/testenv/v1.34.4/bin}
export PATH="$TESTENV_BIN:$PATH"
t0=$(date +%s)
stage() { echo; echo "==> $* ($(( $(date +%s) - t0 ))s)"; }

stage "dependencies"
bash scripts/install-deps.sh
# The venv install-deps.sh made for the proxy's openai-client test.
export FLEXINFER_OPENAI_PYTHON=${FLEXINFER_OPENAI_PYTHON:-$(ls -d "$HOME"/.cache/flexinfer/openai-venv-*/bin/python | tail -1)}
# The venv install-deps.sh made for the GGUF reader test (gguf-py reads and dequantizes what we write).
export FLEXINFER_GGUF_PYTHON=${FLEXINFER_GGUF_PYTHON:-$(ls -d "$HOME"/.cache/flexinfer/gguf-venv-*/bin/python 2>/dev/null | tail -1)}
# The venv install-deps.sh made for the FP8 consumer test (compressed-tensors decompresses and transformers loads
# what we write; crates/flexinfer-quant/tests/fp8_artifact.rs, about 15 s); required here, not skipped.
export FLEXINFER_CT_PYTHON=${FLEXINFER_CT_PYTHON:-$(bash scripts/fp8/make-venv.sh)} FLEXINFER_REQUIRE_CT_PYTHON=1

stage "HIP code objects for gfx1100 and gfx906 (Debian trixie hipcc in an mmdebstrap root, cached)"
FLEXINFER_HIP_CODE_OBJECTS=$(bash scripts/hip/build-code-objects.sh)
export FLEXINFER_HIP_CODE_OBJECTS FLEXINFER_REQUIRE_HIP=1

stage "llama.cpp 0.7.0 for the GGUF tests (Debian sid packages in an mmdebstrap root, cached)"
# crates/flexinfer-quant/tests/gguf_llamacpp.rs: the real llama-server / llama-quantize against our GGUF files.
FLEXINFER_LLAMACPP_ROOT=$(bash scripts/gguf/llamacpp-root.sh)
export FLEXINFER_LLAMACPP_ROOT FLEXINFER_REQUIRE_LLAMACPP=1

stage "cargo fmt --check"
cargo fmt --all -- --check

stage "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -j2 -- -D warnings

stage "build tests"
cargo test --workspace --no-run -j2

stage "start the local control plane (cluster mode)"
ENVF=$(mktemp)
bash scripts/testenv/up.sh cluster > "$ENVF"
# shellcheck disable=SC1090
source "$ENVF"
cleanup() { bash scripts/testenv/down.sh "$TESTENV_DIR" >/dev/null 2>&1 || true; rm -f "$ENVF"; }
trap cleanup EXIT
export FLEXINFER_TESTENV_DIR=$TESTENV_DIR
kubectl apply --server-side -k deploy/crds/ >/dev/null

stage "images, local hub and the Helm-installed controller for the real pipeline (scripts/e2e/setup.sh)"
E2EF=$(mktemp)
E2E_WATCH_NAMESPACE=flexinfer-e2e bash scripts/e2e/setup.sh > "$E2EF"
# shellcheck disable=SC1090
source "$E2EF"; rm -f "$E2EF"

stage "cargo test (unit + integration + real pipeline)"
cargo test --workspace --no-fail-fast -j2 -- --test-threads="${TEST_THREADS:-2}"

stage "chart, kustomize, RBAC, admission policy and alert tests"
bash scripts/chart-tests/run.sh

stage "the production worker has no test hooks"
bash scripts/check-test-hooks.sh

stage "Dockerfile lint (hadolint)"
bash scripts/images/lint.sh

stage "all tests passed"
