# shellcheck shell=bash
# Shared by the scripts that make the Python venvs (scripts/lib/torch-venv.sh, scripts/fp8/make-venv.sh,
# scripts/awq/make-venv.sh). Sourced, not run.

# The site-packages directory of the venv $1.
venv_site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# A new, empty venv at $1 (whatever was there is removed); sets the array pip to its quiet install command.
venv_new() {
  rm -rf "$1"
  python3 -m venv "$1" >&2
  # shellcheck disable=SC2034 # the caller installs with it
  pip=("$1/bin/pip" install -q --disable-pip-version-check)
}

# The venv $1 sees the packages of the shared torch venv (scripts/lib/torch-venv.sh) through a .pth line instead
# of holding a copy of torch; without a torch venv, exits naming the venv as $2.
venv_use_torch() {
  local torch_site own
  torch_site=$(bash "$(dirname "${BASH_SOURCE[0]}")/torch-venv.sh") \
    || { echo "$2: no torch venv" >&2; exit 1; }
  own=$(venv_site "$1")
  echo "$torch_site" > "$own/flexinfer-torch-venv.pth"
}
