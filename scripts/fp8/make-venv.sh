#!/usr/bin/env bash
# The PyPI `compressed-tensors` library (vLLM's checkpoint format library; torch, transformers) in a venv
# cached by version, for the FP8 consumer test (crates/flexinfer-quant/tests/fp8_consumer.rs reads
# FLEXINFER_CT_PYTHON). torch and transformers come from the shared venv of scripts/lib/torch-venv.sh
# (a .pth line, no second copy of torch).
# Prints the venv's python on stdout; everything else goes to stderr.
set -euo pipefail
# shellcheck source=../lib/venv.sh
source "$(dirname "$0")/../lib/venv.sh"
CT_VERSION=${CT_VERSION:-0.20.0}
venv="$HOME/.cache/flexinfer/ct-venv-$CT_VERSION"
check='import compressed_tensors, torch, transformers, safetensors; assert compressed_tensors.__version__.startswith("'"$CT_VERSION"'")'
if ! "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
  echo "compressed-tensors venv: pip install compressed-tensors==$CT_VERSION into $venv" >&2
  venv_new "$venv"
  venv_use_torch "$venv" "compressed-tensors venv"
  "${pip[@]}" "compressed-tensors==$CT_VERSION" >&2 \
    || { echo "compressed-tensors venv: cannot install compressed-tensors==$CT_VERSION from PyPI" >&2; exit 1; }
  "$venv/bin/python" -c "$check" >&2 \
    || { echo "compressed-tensors venv: $venv does not import compressed_tensors $CT_VERSION" >&2; exit 1; }
fi
echo "$venv/bin/python"
