#!/usr/bin/env bash
# GPTQModel (whose AWQ modules transformers loads AWQ checkpoints with; torch, transformers, accelerate) in a
# venv cached by version, for the AWQ consumer test (crates/flexinfer-quant/tests/awq_artifact.rs reads
# FLEXINFER_AWQ_PYTHON). Everything comes from ~/.cache/flexinfer/oracle-venv when it has this GPTQModel (a
# .pth line, no second copy of torch), else GPTQModel is built without CUDA into this venv, on the shared
# torch venv of scripts/lib/torch-venv.sh (again a .pth line). Prints the venv's python on stdout; everything else goes to stderr.
set -euo pipefail
# shellcheck source=../lib/venv.sh
source "$(dirname "$0")/../lib/venv.sh"
GPTQMODEL_VERSION=${GPTQMODEL_VERSION:-7.7.0}
venv="$HOME/.cache/flexinfer/awq-venv-$GPTQMODEL_VERSION"
oracle="$HOME/.cache/flexinfer/oracle-venv"
check='import gptqmodel, torch, transformers, accelerate, safetensors; assert gptqmodel.__version__.startswith("'"$GPTQMODEL_VERSION"'")'
if ! "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
  echo "AWQ venv: GPTQModel $GPTQMODEL_VERSION into $venv" >&2
  venv_new "$venv"
  if GPTQMODEL_CPU_WORKERS=2 "$oracle/bin/python" -c "$check" >/dev/null 2>&1; then
    site=$(venv_site "$oracle")
    own=$(venv_site "$venv")
    echo "$site" > "$own/flexinfer-oracle-venv.pth"
    echo "AWQ venv: GPTQModel, torch and transformers from $oracle" >&2
  else
    venv_use_torch "$venv" "AWQ venv"
    "${pip[@]}" -U "setuptools>=77" wheel >&2 \
      || { echo "AWQ venv: cannot install setuptools" >&2; exit 1; }
    BUILD_CUDA_EXT=0 "${pip[@]}" --no-build-isolation "gptqmodel==$GPTQMODEL_VERSION" >&2 \
      || { echo "AWQ venv: cannot install gptqmodel==$GPTQMODEL_VERSION from PyPI" >&2; exit 1; }
  fi
  GPTQMODEL_CPU_WORKERS=2 "$venv/bin/python" -c "$check" >&2 \
    || { echo "AWQ venv: $venv does not import gptqmodel $GPTQMODEL_VERSION" >&2; exit 1; }
fi
echo "$venv/bin/python"
