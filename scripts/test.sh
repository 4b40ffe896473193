#!/usr/bin/env bash
# The test suite, in three tiers (usage: scripts/test.sh [check|int|e2e|all]):
#   check  cargo fmt --check, clippy -D warnings, the test-hook, module-circle and error-source checks, every test that needs no
#          cluster: the unit tests, the doc tests and every test target not listed below (among them
#          flexinfer-contract's spelled_once, the contract-string check) (make check; no KUBECONFIG, no images,
#          no real node; tests of optional tools — HIP code objects, llama.cpp, Python consumers,
#          oras and the ModelPack validator — skip unless their variables are set, see the `all` stages);
#   int    the test targets of INT_TESTS against the local control plane, then the chart, kustomize, RBAC,
#          admission policy and alert tests (make test-int);
#   e2e    the images, the local hub and the Helm-installed controller (scripts/e2e/setup.sh), the test targets
#          of E2E_TESTS — the real pipeline end to end on the real node — and the Dockerfile lint (make e2e);
#   all    (the default; make test, which .ci/run runs) the dependencies, the HIP code objects, oras, the
#          ModelPack validator and the llama.cpp root (their tests are then required, not skipped), then check,
#          int and e2e in that order on one local cluster.
# int and e2e start the local control plane (kube-apiserver + etcd + controller-manager + scheduler + kwok GPU
# nodes + one real kubelet/containerd node + an OCI registry) once and always tear it down.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
TIER=${1:-all}
case $TIER in check|int|e2e|all) ;; *) echo "usage: $0 [check|int|e2e|all]" >&2; exit 2;; esac
export TESTENV_BIN=${TESTENV_BIN:-$HOME/.cache/testenv/v1.34.4/bin}
export PATH="$TESTENV_BIN:$PATH"
t0=$(date +%s)
stage() { echo; echo "==> $* ($(( $(date +%s) - t0 ))s)"; }

# The test targets that need a running cluster, as package:target: the one list of them. `make check` runs every
# other test target of the workspace, so a new test file that talks to the API server belongs here (without
# KUBECONFIG it fails loudly, by design). scripts/test-targets.py turns the lists into cargo arguments and fails
# when an entry names no target.
INT_TESTS=(                            # the local control plane (KUBECONFIG; cluster mode: kwok GPU nodes)
  flexinfer-cli:cluster
  flexinfer-controller:event_series
  flexinfer-controller:leader_election
  flexinfer-controller:model_controller
  flexinfer-controller:pipeline_e2e
  flexinfer-controller:reconcile_panics
  flexinfer-controller:scale_budget
  flexinfer-proxy:proxy
  flexinfer-e2e:crds
)
E2E_TESTS=(                            # also the images, the hub, the Helm-installed controller, the real node
  flexinfer-e2e:real_pipeline
)

# cargo_test TIER [PKG:TARGET...]: `cargo test` of what scripts/test-targets.py selects, one cargo call per
# line it prints; every call runs (like --no-fail-fast). A failure fails the tier, except under `all`, where the
# other tiers' tests still run (as one `cargo test --workspace --no-fail-fast` did) and the run fails at the end.
KEEP_GOING=0; TESTS_FAILED=0
cargo_test() {
  local tier=$1 args failed=0; shift
  local calls; calls=$(cargo metadata --no-deps --format-version 1 | python3 scripts/test-targets.py "$tier" "$@")
  mapfile -t calls <<< "$calls"
  for args in "${calls[@]}"; do
    # shellcheck disable=SC2086
    cargo test $args --no-fail-fast -j2 -- --test-threads="${TEST_THREADS:-2}" || failed=1
  done
  [ $failed = 0 ] && return 0
  [ $KEEP_GOING = 1 ] && { TESTS_FAILED=1; echo "(tests failed: going on with the other tiers)"; return 0; }
  return 1
}

deps() {
  stage "dependencies"
  bash scripts/install-deps.sh
  # The venv install-deps.sh made for the proxy's openai-client test.
  export FLEXINFER_OPENAI_PYTHON=${FLEXINFER_OPENAI_PYTHON:-$(ls -d "$HOME"/.cache/flexinfer/openai-venv-*/bin/python | tail -1)}
  # The venv install-deps.sh made for the GGUF reader test (gguf-py reads and dequantizes what we write).
  export FLEXINFER_GGUF_PYTHON=${FLEXINFER_GGUF_PYTHON:-$(ls -d "$HOME"/.cache/flexinfer/gguf-venv-*/bin/python 2>/dev/null | tail -1)}
}

optional_tools() {
  # The venv install-deps.sh made for the FP8 consumer test (compressed-tensors decompresses and transformers loads
  # what we write; crates/flexinfer-quant/tests/fp8_artifact.rs, about 15 s; the pack-quantized one,
  # crates/flexinfer-quant/tests/ct_artifact.rs, about 70 s); required here, not skipped.
  export FLEXINFER_CT_PYTHON=${FLEXINFER_CT_PYTHON:-$(bash scripts/fp8/make-venv.sh)} FLEXINFER_REQUIRE_CT_PYTHON=1
  # The venv install-deps.sh made for the AWQ consumer test (GPTQModel's AWQ reader dequantizes and transformers
  # loads what we write; crates/flexinfer-quant/tests/awq_artifact.rs, about 20 s); required here, not skipped.
  export FLEXINFER_AWQ_PYTHON=${FLEXINFER_AWQ_PYTHON:-$(bash scripts/awq/make-venv.sh)} FLEXINFER_REQUIRE_AWQ_PYTHON=1

  stage "HIP code objects for gfx1100 and gfx906 (Debian trixie hipcc in an mmdebstrap root, cached)"
  FLEXINFER_HIP_CODE_OBJECTS=$(bash scripts/hip/build-code-objects.sh)
  export FLEXINFER_HIP_CODE_OBJECTS FLEXINFER_REQUIRE_HIP=1

  stage "oras 1.3.6 and the ModelPack validator (built from the Go module proxy, cached by version)"
  # crates/flexinfer-worker/tests/publish_consumers.rs: the CNCF ModelPack spec's own validator
  # (github.com/modelpack/model-spec, pinned in scripts/modelpack/validate/go.mod) accepts a published
  # artifact and rejects broken ones; `oras pull` rebuilds the published tree byte for byte. A cold build
  # of both adds about half a minute on a fresh machine.
  FLEXINFER_ORAS=$(bash scripts/oras/oras.sh)
  FLEXINFER_MODELPACK_VALIDATE=$(bash scripts/modelpack/validator.sh)
  export FLEXINFER_ORAS FLEXINFER_MODELPACK_VALIDATE FLEXINFER_REQUIRE_OCI_TOOLS=1

  stage "llama.cpp 0.7.0 for the GGUF tests (Debian sid packages in an mmdebstrap root, cached)"
  # crates/flexinfer-quant/tests/gguf_llamacpp.rs: the real llama-server / llama-quantize against our GGUF files.
  FLEXINFER_LLAMACPP_ROOT=$(bash scripts/gguf/llamacpp-root.sh)
  export FLEXINFER_LLAMACPP_ROOT FLEXINFER_REQUIRE_LLAMACPP=1
}

check() {
  stage "cargo fmt --check"
  cargo fmt --all -- --check

  stage "cargo clippy --all-targets -- -D warnings"
  cargo clippy --workspace --all-targets -j2 -- -D warnings

  stage "the production worker has no test hooks"
  bash scripts/check-test-hooks.sh

  stage "no import circle among the modules below (the planners' steps, the engine's device, model, job and GGUF parts)"
  python3 scripts/check-module-cycles.py --self-test
  python3 scripts/check-module-cycles.py \
    crates/flexinfer-api/src . crates/flexinfer-proxy/src . crates/flexinfer-quant/src . \
    crates/flexinfer-controller/src . crates/flexinfer-contract/src . crates/flexinfer-worker/src . crates/flexinfer-worker/src abliterate \
    crates/flexinfer-controller/src modelcache crates/flexinfer-controller/src model \
    crates/flexinfer-quant/src device crates/flexinfer-quant/src gguf crates/flexinfer-quant/src numerics \
    crates/flexinfer-quant/src model crates/flexinfer-quant/src job crates/flexinfer-cli/src . \
    crates/flexinfer-cli/src artifact crates/flexinfer-worker/src download crates/flexinfer-worker/src oci \
    crates/flexinfer-runtime/src . crates/flexinfer-plan/src . crates/flexinfer-plan/src modelcache crates/flexinfer-plan/src model \
    crates/flexinfer-hub/src .

  stage "no error prints its own source in its message (a printer of the chain would show it twice)"
  python3 scripts/check-error-sources.py --self-test
  python3 scripts/check-error-sources.py crates tests

  stage "cargo test: every test that needs no cluster"
  cargo_test check "${INT_TESTS[@]}" "${E2E_TESTS[@]}"
}

cluster_up() {
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
}

int() {
  stage "cargo test: the control-plane tests"
  cargo_test only "${INT_TESTS[@]}"

  stage "chart, kustomize, RBAC, admission policy and alert tests"
  bash scripts/chart-tests/run.sh
}

e2e() {
  stage "images, local hub and the Helm-installed controller for the real pipeline (scripts/e2e/setup.sh)"
  E2EF=$(mktemp)
  E2E_WATCH_NAMESPACE=flexinfer-e2e bash scripts/e2e/setup.sh > "$E2EF"
  # shellcheck disable=SC1090
  source "$E2EF"; rm -f "$E2EF"

  stage "cargo test: the real pipeline"
  cargo_test only "${E2E_TESTS[@]}"

  stage "Dockerfile lint (hadolint)"
  bash scripts/images/lint.sh
}

case $TIER in
  check) check ;;
  int) deps; cluster_up; int ;;
  e2e) deps; cluster_up; e2e ;;
  all) KEEP_GOING=1; deps; optional_tools; check; cluster_up; int; e2e ;;
esac

[ $TESTS_FAILED = 0 ] || { stage "tests failed (see the cargo test output above)"; exit 1; }
stage "all tests passed"
