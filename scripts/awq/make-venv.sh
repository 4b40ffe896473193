#!/usr/bin/env bash
# GPTQModel (whose AWQ modules transformers loads AWQ checkpoints with; torch, transformers, accelerate) in a
# venv cached by version, for the AWQ consumer test (crates/flexinfer-quant/tests/awq_artifact.rs reads
# FLEXINFER_AWQ_PYTHON). Everything comes from ~/.cache/flexinfer/oracle-venv when it has this GPTQModel (a
# .pth line, no second copy of torch), else GPTQModel is built without CUDA into this venv, on the shared
# torch venv of scripts/lib/torch-venv.sh (again a .pth line). Prints the venv's python on stdout; everything else goes to stderr.
set -euo pipefail
GPTQMODEL_VERSION=${GPTQMODEL_VERSION:-7.7.0}
venv="$HOME/.cache/flexinfer/awq-venv-$GPTQMODEL_VERSION"
oracle="$HOME/.cache/flexinfer/oracle-venv"
check='import gptqmodel, torch, transformers, accelerate, safetensors; assert gptqmodel.__version__.startswith("'"$GPTQMODEL_VERSION"'")'
if ! "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
  echo "AWQ venv: GPTQModel $GPTQMODEL_VERSION into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  pip=("$venv/bin/pip" install -q --disable-pip-version-check)
  if GPTQMODEL_CPU_WORKERS=2 "$oracle/bin/python" -c "$check" >/dev/null 2>&1; then
    site=$("$oracle/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$site" > "$own/flexinfer-oracle-venv.pth"
    echo "AWQ venv: GPTQModel, torch and transformers from $oracle" >&2
  else
    torch_site=$(bash "$(dirname "$0")/../lib/torch-venv.sh") \
      || { echo "AWQ venv: no torch venv" >&2; exit 1; }
    own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$torch_site" > "$own/flexinfer-torch-venv.pth"
    "${pip[@]}" -U "setuptools>=77" wheel >&2 \
      || { echo "AWQ venv: cannot install setuptools" >&2; exit 1; }
    BUILD_CUDA_EXT=0 "${pip[@]}" --no-build-isolation "gptqmodel==$GPTQMODEL_VERSION" >&2 \
      || { echo "AWQ venv: cannot install gptqmodel==$GPTQMODEL_VERSION from PyPI" >&2; exit 1; }
  fi
  GPTQMODEL_CPU_WORKERS=2 "$venv/bin/python" -c "$check" >&2 \
    || { echo "AWQ venv: $venv does not import gptqmodel $GPTQMODEL_VERSION" >&2; exit 1; }
fi
echo "$venv/bin/python"
