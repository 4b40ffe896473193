# FlexInfer developer entry points.
SHELL := /bin/bash
.PHONY: test demo crds crds-check testenv-bins lint fmt build chart-tests

## Run every test: fmt, clippy, unit, integration (real control plane), chart and alert tests.
test:
	bash scripts/test.sh

## The main job: local cluster + controller + an example ModelCache walking to Ready.
demo:
	bash scripts/demo.sh

## Regenerate the CRD YAML from the Rust types into deploy/crds and charts/flexinfer/crds.
crds:
	cargo run -q -p flexinfer-api --bin crdgen -- .

## Fail when the checked-in CRD YAML is stale.
crds-check:
	cargo run -q -p flexinfer-api --bin crdgen -- --check .

## Build (or reuse from ~/.cache/testenv) kube-apiserver, etcd, controller-manager, scheduler, kwok, helm.
testenv-bins:
	bash scripts/testenv/build-bins.sh

build:
	cargo build --workspace -j2

fmt:
	cargo fmt --all

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -j2 -- -D warnings

chart-tests:
	bash scripts/chart-tests/run.sh

# Regenerates tests/fixtures/oracle/ with Hugging Face transformers (issue #17). Not run in CI: needs a Python
# with torch, transformers and safetensors, e.g.
#   python3 -m venv ~/.cache/flexinfer/oracle-venv && ~/.cache/flexinfer/oracle-venv/bin/pip install torch transformers safetensors
ORACLE_PYTHON ?= $(HOME)/.cache/flexinfer/oracle-venv/bin/python
.PHONY: oracle
oracle:
	$(ORACLE_PYTHON) scripts/oracle/make_fixtures.py
	cargo test -p flexinfer-quant --test oracle
