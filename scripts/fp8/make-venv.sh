#!/usr/bin/env bash
# The PyPI `compressed-tensors` library (vLLM's checkpoint format library; torch, transformers) in a venv
# cached by version, for the FP8 consumer test (crates/flexinfer-quant/tests/fp8_consumer.rs reads
# FLEXINFER_CT_PYTHON). torch and transformers come from ~/.cache/flexinfer/oracle-venv when it has
# them (a .pth line, no second copy of torch), else the CPU wheels are installed into this venv.
# Prints the venv's python on stdout; everything else goes to stderr.
set -euo pipefail
CT_VERSION=${CT_VERSION:-0.20.0}
venv="$HOME/.cache/flexinfer/ct-venv-$CT_VERSION"
oracle="$HOME/.cache/flexinfer/oracle-venv"
check='import compressed_tensors, torch, transformers, safetensors; assert compressed_tensors.__version__.startswith("'"$CT_VERSION"'")'
if ! "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
  echo "compressed-tensors venv: pip install compressed-tensors==$CT_VERSION into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  pip=("$venv/bin/pip" install -q --disable-pip-version-check)
  if "$oracle/bin/python" -c 'import torch, transformers, safetensors' >/dev/null 2>&1; then
    site=$("$oracle/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$site" > "$own/flexinfer-oracle-venv.pth"
    echo "compressed-tensors venv: torch and transformers from $oracle" >&2
  else
    "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu torch >&2 \
      || { echo "compressed-tensors venv: cannot install the torch CPU wheel" >&2; exit 1; }
    "${pip[@]}" transformers safetensors >&2 \
      || { echo "compressed-tensors venv: cannot install transformers" >&2; exit 1; }
  fi
  "${pip[@]}" "compressed-tensors==$CT_VERSION" >&2 \
    || { echo "compressed-tensors venv: cannot install compressed-tensors==$CT_VERSION from PyPI" >&2; exit 1; }
  "$venv/bin/python" -c "$check" >&2 \
    || { echo "compressed-tensors venv: $venv does not import compressed_tensors $CT_VERSION" >&2; exit 1; }
fi
echo "$venv/bin/python"
