# FlexInfer developer entry points.
SHELL := /bin/bash
.PHONY: test check test-int e2e demo crds crds-check testenv-bins lint fmt build chart-tests

# The tests come in three tiers; scripts/test.sh runs them and lists the test targets that need a cluster.
## Run every test: installs what the suite needs, then check, test-int and e2e on one local cluster (CI runs this).
test:
	bash scripts/test.sh

## The fast tier: fmt, clippy, the contract-string check and every test that needs no cluster (no KUBECONFIG,
## no images, no real node, no HIP build).
check:
	bash scripts/test.sh check

## The tests that need the local control plane (started and torn down here), then the chart and alert tests.
test-int:
	bash scripts/test.sh int

## Images, the Helm-installed controller and the real pipeline on the real node; Dockerfile lint.
e2e:
	bash scripts/test.sh e2e

## The main job: local cluster + controller + an example ModelCache walking to Ready.
demo:
	bash scripts/demo.sh

## Regenerate the CRD YAML from the Rust types into deploy/crds and charts/flexinfer/files/crds.
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

# Regenerates tests/fixtures/oracle/ with Hugging Face transformers. Not run in CI: needs a Python
# with torch, transformers and safetensors (make oracle-check below also needs optimum and gptqmodel), e.g.
#   python3 -m venv ~/.cache/flexinfer/oracle-venv && ~/.cache/flexinfer/oracle-venv/bin/pip install torch transformers safetensors
# It also trains the small TRAINED Llama of the low-bit quality benchmark (a few minutes on the CPU,
# written once to LOWBIT_MODEL, never committed; needs tokenizers too).
ORACLE_PYTHON ?= $(HOME)/.cache/flexinfer/oracle-venv/bin/python
LOWBIT_MODEL ?= $(HOME)/.cache/flexinfer/lowbit-model
.PHONY: oracle
oracle:
	$(ORACLE_PYTHON) scripts/oracle/make_fixtures.py
	cargo test -p flexinfer-quant --test oracle
	test -f $(LOWBIT_MODEL)/model.safetensors || $(ORACLE_PYTHON) scripts/oracle/train_tiny_llama.py $(LOWBIT_MODEL)

# GPTQ at 4/3/2 bits on the trained model: perplexity and KL per knob vs RTN (and GPTQModel with
# LOWBIT_GPTQMODEL=1); docs/benchmarks.md "GPTQ at 4, 3 and 2 bits on a trained model". Not a test.
.PHONY: lowbit-bench
lowbit-bench:
	ORACLE_PYTHON=$(ORACLE_PYTHON) LOWBIT_MODEL=$(LOWBIT_MODEL) scripts/bench/quant/lowbit.sh

# Whether transformers loads the engine's gptq checkpoints (not in CI, see docs/user/gptq-engine.md
# "Loaded by transformers"): quantizes every oracle fixture (examples/quantize_dir: 4 bits, group 32, or 16 where
# an input dimension is 16) into ORACLE_CHECK_DIR and runs make_fixtures.py --check-quantized on the results:
# loaded or not, logits against the fixture's, our dequantization against the backend's. The venv also needs a
# GPTQ backend for CPU: ~/.cache/flexinfer/oracle-venv/bin/pip install optimum gptqmodel (GPTQModel's kernel
# choice: ORACLE_GPTQ_BACKEND, auto or torch, the pure-torch kernel).
ORACLE_CHECK_DIR ?= $(HOME)/.cache/flexinfer/oracle-gptq
ORACLE_GPTQ_BACKEND ?= auto
ORACLE_FAMILIES ?= qwen3 qwen3_moe qwen3_moe_no_norm_topk mixtral qwen2_moe gemma2 gemma3_text gemma4_text \
	gemma4_moe gemma4_mm qwen3_next qwen3_5 qwen3_5_moe_mm
.PHONY: oracle-check
oracle-check:
	cargo build -p flexinfer-quant --example quantize_dir
	set -e; for f in $(ORACLE_FAMILIES); do \
	  case $$f in gemma4_moe|qwen3_next|qwen3_5_moe_mm) g=16;; *) g=32;; esac; \
	  cargo run -q -p flexinfer-quant --example quantize_dir -- tests/fixtures/oracle/$$f $(ORACLE_CHECK_DIR)/$$f $$g 4; \
	done
	$(ORACLE_PYTHON) scripts/oracle/make_fixtures.py --check-quantized --json $(ORACLE_CHECK_DIR)/check.json \
	  --backend $(ORACLE_GPTQ_BACKEND) \
	  $(addprefix $(ORACLE_CHECK_DIR)/,$(ORACLE_FAMILIES))

# Build and push the worker (quantizer) image variant of QUANTIZER_ARCH (gfx1100 -> rocm-gfx1100, gfx906 ->
# rocm-gfx906, sm_XX -> cuda; QUANTIZER_VARIANT=cpu|cuda|rocm-gfx1100|rocm-gfx906 overrides), point the
# GPUProfiles of QUANTIZER_ARCH at it (pinned by digest), optionally move a running quantization onto it:
# make deploy-quantizer QUANTIZER_ARCH=gfx1100 REGISTRY=host:port [QUANTIZER_VARIANT=…] [DRY_RUN=1]
# [RESTART_JOB=namespace/cache] [NAMESPACE=ns]. See scripts/deploy-quantizer.sh --help.
.PHONY: deploy-quantizer
deploy-quantizer:
	@test -n "$(QUANTIZER_ARCH)" || { echo "QUANTIZER_ARCH is required (e.g. gfx1100)"; exit 2; }
	@test -n "$(REGISTRY)" || { echo "REGISTRY is required (host:port the cluster pulls from)"; exit 2; }
	$(if $(DRY_RUN),,$(MAKE) worker-bin)
	bash scripts/deploy-quantizer.sh $(QUANTIZER_ARCH) --registry $(REGISTRY) \
	  $(if $(QUANTIZER_VARIANT),--variant $(QUANTIZER_VARIANT)) \
	  $(if $(NAMESPACE),-n $(NAMESPACE)) $(if $(RESTART_JOB),--restart $(RESTART_JOB)) $(if $(DRY_RUN),--dry-run)

# The worker binary with the HIP code objects for gfx1100 and gfx906 embedded (crates/flexinfer-quant/build.rs;
# scripts/hip/build-code-objects.sh compiles them with Debian trixie's hipcc in a cached mmdebstrap root: root).
.PHONY: worker-bin
worker-bin:
	FLEXINFER_HIP_CODE_OBJECTS=$$(bash scripts/hip/build-code-objects.sh) && export FLEXINFER_HIP_CODE_OBJECTS \
	  && cargo build -p flexinfer-worker -j2

# The worker image's GPU variants (scripts/images/variants.sh), daemonless from the built worker binary, into
# scripts/images/build.sh's archive directory: flexinfer/worker:$(IMAGE_TAG)-<variant> (cpu: $(IMAGE_TAG)).
# Needs root (mmdebstrap, chroot). Without BIN_DIR, builds the worker binary first (worker-bin, with the HIP
# code objects embedded); a BIN_DIR binary must embed them for the ROCm variants. Not part of `make test`
# (hundreds of MB of packages). make worker-images [VARIANTS="cuda rocm-gfx1100"] [IMAGE_TAG=dev]
# [BIN_DIR=…] [PUSH=host:port]
VARIANTS ?= cuda rocm-gfx1100 rocm-gfx906
IMAGE_TAG ?= dev
.PHONY: worker-images
worker-images: $(if $(BIN_DIR),,worker-bin)
	bash scripts/images/build.sh --tag $(IMAGE_TAG) $(foreach v,$(VARIANTS),--variant $(v)) \
	  $(if $(BIN_DIR),--bin-dir $(BIN_DIR)) $(if $(PUSH),--push $(PUSH))
