#!/usr/bin/env bash
# The PyPI `gguf` package (llama.cpp's reader; numpy only) in a venv cached by version, for the GGUF
# reader test (crates/flexinfer-quant/tests/gguf_python.rs reads FLEXINFER_GGUF_PYTHON).
# Prints the venv's python on stdout; everything else goes to stderr.
set -euo pipefail
GGUF_PY_VERSION=${GGUF_PY_VERSION:-0.19.0}
venv="$HOME/.cache/flexinfer/gguf-venv-$GGUF_PY_VERSION"
if ! "$venv/bin/python" -c 'import gguf, gguf.quants, numpy' >/dev/null 2>&1; then
  echo "gguf venv: pip install gguf==$GGUF_PY_VERSION into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "gguf==$GGUF_PY_VERSION" >&2 \
    || { echo "gguf venv: cannot install gguf==$GGUF_PY_VERSION from PyPI" >&2; exit 1; }
fi
echo "$venv/bin/python"
