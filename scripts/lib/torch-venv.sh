#!/usr/bin/env bash
# One venv with torch, transformers, safetensors and accelerate, shared by the Python consumer venvs
# (scripts/fp8/make-venv.sh, scripts/awq/make-venv.sh), which point at it with a .pth line instead of
# holding a copy of torch each. Prints that venv's site-packages directory on stdout; the rest goes to stderr.
#
# ~/.cache/flexinfer/oracle-venv (make oracle) is used when it has the four packages. Otherwise
# ~/.cache/flexinfer/torch-venv-$TORCH_VERSION is made once: torch's CPU wheel from download.pytorch.org
# when that host answers (about 200 MB), else PyPI's torch (the CUDA build: about 3 GB with its nvidia-*
# wheels; it runs on the CPU too). PyPI is the only index a fresh machine is sure to reach.
set -euo pipefail
TORCH_VERSION=${TORCH_VERSION:-2.15.0}
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.23.0}
cache="$HOME/.cache/flexinfer"
oracle="$cache/oracle-venv"
venv="$cache/torch-venv-$TORCH_VERSION"
check='import torch, transformers, safetensors, accelerate'
# shellcheck source=venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"

if "$oracle/bin/python" -c "$check" >/dev/null 2>&1; then
  echo "torch venv: torch and transformers from $oracle" >&2
  venv_site "$oracle"
  exit 0
fi
mkdir -p "$cache"
exec 9>"$cache/torch-venv.lock"
flock 9
if ! "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
  echo "torch venv: torch $TORCH_VERSION and transformers $TRANSFORMERS_VERSION into $venv" >&2
  venv_new "$venv"
  if "${pip[@]}" --retries 0 --timeout 15 --index-url https://download.pytorch.org/whl/cpu \
      "torch==$TORCH_VERSION" >&2 2>/dev/null; then
    echo "torch venv: the CPU wheel from download.pytorch.org" >&2
  else
    echo "torch venv: download.pytorch.org not reachable; torch $TORCH_VERSION from PyPI" >&2
    "${pip[@]}" "torch==$TORCH_VERSION" >&2 \
      || { echo "torch venv: cannot install torch==$TORCH_VERSION from PyPI" >&2; exit 1; }
  fi
  "${pip[@]}" "transformers==$TRANSFORMERS_VERSION" safetensors accelerate setuptools wheel >&2 \
    || { echo "torch venv: cannot install transformers==$TRANSFORMERS_VERSION" >&2; exit 1; }
  "$venv/bin/python" -c "$check" >&2 \
    || { echo "torch venv: $venv does not import torch and transformers" >&2; exit 1; }
fi
venv_site "$venv"
