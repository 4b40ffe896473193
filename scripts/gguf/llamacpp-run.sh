#!/usr/bin/env bash
# Run a command inside the llama.cpp root of scripts/gguf/llamacpp-root.sh, with a host directory bound at
# /work (also its working directory, HOME and TMPDIR):
#
#   bash scripts/gguf/llamacpp-run.sh ROOT DIR llama-completion -m /work/model.gguf -p hi -n 8
#
# The mounts (/proc, /dev, /work) live in a private mount namespace and vanish with the command; the
# network namespace is the host's (llama-server on 127.0.0.1 is reachable from the host). The command's
# exit status is returned. Needs root (unshare, mount, chroot).
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 ROOT DIR COMMAND [ARG...]" >&2; exit 2; }
root=$1 dir=$2; shift 2
[ -f "$root/.flexinfer-root-complete" ] || { echo "llamacpp-run: $root is not a finished llama.cpp root" >&2; exit 2; }
[ -d "$dir" ] || { echo "llamacpp-run: no directory $dir" >&2; exit 2; }
dir=$(cd "$dir" && pwd)
# shellcheck disable=SC2016
exec unshare --mount --propagation private -- /bin/sh -c '
  r=$1; w=$2; shift 2
  mount -t proc proc "$r/proc" && mount --rbind /dev "$r/dev" && mkdir -p "$r/work" && mount --bind "$w" "$r/work" \
    && exec chroot "$r" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/work TMPDIR=/work LANG=C.UTF-8 \
         /bin/sh -c "cd /work && exec \"\$@\"" sh "$@"' sh "$root" "$dir" "$@"
