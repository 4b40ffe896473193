#!/usr/bin/env bash
# Check the archives scripts/images/build.sh wrote, without any cluster or daemon of ours running:
#   1. image config: user 65532:65532, the entrypoint;
#   2. unpack with umoci, list each binary's shared libraries with the image's own loader (none may be
#      missing) and run `<binary> --help` in the rootfs as 65532:65532 (chroot, then runc where it
#      works here: the bundle umoci writes has its own network namespace, loopback only);
#   3. push to a docker-registry started on 127.0.0.1 (storage in a temp dir, stopped afterwards),
#      copy back, compare manifest and config digests;
#   4. where containerd is installed: import into a private containerd (temp root, unix socket
#      only) with `ctr images import`, as scripts/testenv/load-image.sh would, and run --help there.
#
#   bash scripts/images/verify.sh [--out DIR] [--tag TAG]     # same defaults as build.sh
#   bash scripts/images/verify.sh --variant cuda [--variant rocm-gfx1100 …] [--out DIR] [--tag TAG]
#     the worker variants (build.sh --variant) instead: steps 1 and 2 for flexinfer/worker:TAG-V, plus its
#     labels, the runtime library the GPU session dlopens (its soname file present, all of its dependencies
#     resolved by the image's own loader: `ld.so --list`, no "not found"), no libcuda in the image, and for
#     ROCm that the image's flexinfer-worker embeds the code object of its gfx target (`flexinfer-worker
#     devices` run in the rootfs as 65532), the one the dev.flexinfer.hip-code-object label names by SHA-256.
#   bash scripts/images/verify.sh --llamacpp cpu [--llamacpp vulkan --llamacpp rocm] [--gguf FILE | --bin-dir DIR]
#     the llama.cpp images (build.sh --only llamacpp[-vulkan|-rocm]; cpu is also checked by default when its
#     archive exists): steps 1, 3 and 4, their labels (package versions as in the image; rocm: the gfx targets
#     equal what hip-offload-targets.py reads from the image's libggml-hip.so), /app/llama-server, the shell
#     tools of the controller's directory command line, every library of llama-server and of the flavor's ggml
#     backends resolved by the image's loader, `llama-server --version` and `--list-devices` as 65532, and
#     llama-server serving a GGUF file from the image's root (mounted read-only, /tmp a tmpfs, the model
#     read-only at /models, the host's network): the controller's "first .gguf of a directory" command line,
#     GET /health, then POST /v1/chat/completions. The GGUF is FILE, or one our engine writes here:
#     scripts/gguf/tiny-model.py (a 5 MB random Llama) quantized to Q4_K_M by DIR/flexinfer-worker (FORMAT=GGUF;
#     DIR defaults to build.sh's). A machine without a GPU serves on the CPU with every flavor.
# shellcheck disable=SC2015  # `test && ok || bad`: ok only prints, it cannot fail
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=scripts/images/lib.sh
. "$here/lib.sh"
# shellcheck source=scripts/images/variants.sh
. "$here/variants.sh"
out=$FLEXINFER_IMAGES_CACHE/out
tag=dev
variants=() flavors=()
gguf="" bin_dir=${CARGO_TARGET_DIR:-$HOME/.cache/flexinfer/target}/debug
while (($#)); do
  case $1 in
    --llamacpp)
      images_llamacpp_flavor_valid "$2" || images_die "no llama.cpp flavor $2 (${IMAGES_LLAMACPP_FLAVORS[*]})"
      flavors+=("$2"); shift 2 ;;
    --gguf) gguf=$2; shift 2 ;;
    --bin-dir) bin_dir=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --variant) images_variant_valid "$2" || images_die "no variant $2 (${IMAGES_VARIANTS[*]})"; variants+=("$2"); shift 2 ;;
    *) images_die "unknown argument: $1" ;;
  esac
done
[[ $(id -u) == 0 ]] || images_die "verify.sh needs root (umoci unpack, chroot, runc)"
for t in skopeo umoci jq; do command -v $t >/dev/null || images_die "$t not installed"; done

tmp=$(mktemp -d)
reg_pid="" ctrd_pid=""
cleanup() {
  local rc=$?
  set +e
  [[ -z $ctrd_pid ]] || { kill "$ctrd_pid" 2>/dev/null; wait "$ctrd_pid" 2>/dev/null || true; }
  [[ -z $reg_pid ]] || { kill "$reg_pid" 2>/dev/null; wait "$reg_pid" 2>/dev/null || true; }
  # containerd leaves overlay mounts under its root on an unclean stop
  grep -o " $tmp/[^ ]*" /proc/mounts | sort -r | while read -r m; do umount "$m" 2>/dev/null || true; done
  rm -rf "$tmp"
  exit "$rc"
}
trap cleanup EXIT
fail=0 checked=0
ok() { printf '  ok    %s\n' "$*"; }
# A binary without --help (flexinfer-standin) still proves it loaded when it exits with its own
# "<name>: ..." diagnostic rather than a loader or exec error.
ran() { [[ $2 == "$1: "* ]]; }
bad() { printf '  FAIL  %s\n' "$*"; fail=1; }

declare -A entry=([controller]=/usr/local/bin/flexinfer-controller [worker]=/usr/local/bin/flexinfer-worker
  [standin]=/usr/local/bin/flexinfer-standin [proxy]=/usr/local/bin/flexinfer-proxy [llamacpp]=/app/llama-server)
declare -A helps=([controller]="flexinfer-controller flexinfer" [worker]="flexinfer-worker flexinfer-standin"
  [standin]="flexinfer-standin" [proxy]="flexinfer-proxy" [llamacpp]="")
images=(controller worker standin proxy llamacpp)
declare -A itags=() ivariant=()
for img in "${images[@]}"; do itags[$img]=$tag; done
((${#variants[@]} + ${#flavors[@]})) && images=()
for f in "${flavors[@]}"; do
  # units llamacpp (cpu), llamacpp@vulkan, llamacpp@rocm
  if [[ $f == cpu ]]; then images+=(llamacpp)
  else
    images+=("llamacpp@$f"); itags[llamacpp@$f]=$tag-$f ivariant[llamacpp@$f]=$f
    entry[llamacpp@$f]=${entry[llamacpp]} helps[llamacpp@$f]=""
  fi
done
if ((${#variants[@]})); then
  # units named worker@V; everything below reads the archive of itags[unit]
  for v in "${variants[@]}"; do
    images+=("worker@$v"); itags[worker@$v]=$(images_variant_tag "$tag" "$v")
    [[ $v == cpu ]] || ivariant[worker@$v]=$v # cpu: the plain worker image
    entry[worker@$v]=${entry[worker]} helps[worker@$v]=${helps[worker]}
  done
fi

# The GGUF the llama.cpp images serve: --gguf, else one our engine writes (once per run) into $tmp/models.
llamacpp_model() {
  [[ -z $(find "$tmp/models" -name '*.gguf' 2>/dev/null) ]] || return 0
  mkdir -p "$tmp/models"
  if [[ -n $gguf ]]; then
    [[ -f $gguf ]] || { echo "--gguf $gguf: no such file"; return 1; }
    install -m 0644 "$gguf" "$tmp/models/"
    echo "$gguf"; return 0
  fi
  local w=$bin_dir/flexinfer-worker t0
  [[ -x $w ]] || { echo "no $w to write a GGUF with (give --bin-dir DIR or --gguf FILE)"; return 1; }
  t0=$(date +%s)
  python3 "$root/scripts/gguf/tiny-model.py" "$tmp/tiny" || return 1
  if ! FORMAT=GGUF GGUF_TYPE=Q4_K_M MODEL_DIR=$tmp/tiny/model OUT_DIR=$tmp/tiny/gguf \
    DATASET=$tmp/tiny/calibration.jsonl "$w" quantize > "$tmp/tiny/quantize.log" 2>&1; then
    echo "$w quantize (FORMAT=GGUF): $(tail -2 "$tmp/tiny/quantize.log")"; return 1
  fi
  install -m 0644 "$tmp"/tiny/gguf/*.gguf "$tmp/models/"
  echo "$(cd "$tmp/models" && ls) ($(stat -c %s "$tmp"/models/*.gguf) bytes), written by $w quantize FORMAT=GGUF GGUF_TYPE=Q4_K_M from scripts/gguf/tiny-model.py in $(($(date +%s) - t0)) s"
}

# check_llamacpp FLAVOR ROOTFS CONFIG: the llama.cpp image checks (see the header).
check_llamacpp() {
  local flavor=$1 rootfs=$2 cfg=$3 label pkgs want got p v lib libs o srv port i health reply content
  jq -e '.config.Env | index("HOME=/tmp")' <<<"$cfg" >/dev/null && ok "env HOME=/tmp" || bad "env: $(jq -c .config.Env <<<"$cfg") (want HOME=/tmp)"
  while read -r label pkgs; do
    got=$(jq -r --arg l "dev.flexinfer.$label" '.config.Labels[$l] // ""' <<<"$cfg")
    want=""
    for p in $pkgs; do
      v=$(sed -n "s/^Version: //p" "$rootfs/var/lib/dpkg/status.d/$p" 2>/dev/null)
      want+="${want:+,}$p=${v:-?}"
    done
    [[ -n $got && $got == "$want" ]] && ok "label dev.flexinfer.$label=$got (as in the image)" || bad "label dev.flexinfer.$label '$got' (the image has $want)"
  done < <(images_llamacpp_labels "$flavor")
  if [[ $flavor != cpu ]]; then
    got=$(jq -r '.config.Labels["dev.flexinfer.variant"] // ""' <<<"$cfg")
    [[ $got == "$flavor" ]] && ok "label dev.flexinfer.variant=$got" || bad "label dev.flexinfer.variant '$got' (want $flavor)"
  fi
  if [[ $flavor == rocm ]]; then
    got=$(jq -r '.config.Labels["dev.flexinfer.gfx-targets"] // ""' <<<"$cfg")
    lib=$(cd "$rootfs" && find usr/lib -name libggml-hip.so | head -1)
    want=$( [[ -n $lib ]] && python3 "$here/hip-offload-targets.py" "$rootfs/$lib" 2>/dev/null | paste -sd, -)
    [[ -n $got && $got == "$want" ]] && ok "label dev.flexinfer.gfx-targets=$got (the offload bundles of /$lib)" \
      || bad "label dev.flexinfer.gfx-targets '$got', /$lib has code for '$want'"
  fi
  [[ -L $rootfs/app/llama-server && $(readlink "$rootfs/app/llama-server") == /usr/bin/llama-server && -x $rootfs/usr/bin/llama-server ]] \
    && ok "/app/llama-server -> /usr/bin/llama-server" || bad "/app/llama-server is not a link to an executable /usr/bin/llama-server"
  for p in sh find sort head; do
    [[ -x $rootfs/bin/$p ]] && ok "/bin/$p -> $(readlink -f "$rootfs/bin/$p" | sed "s|^$rootfs||")" || bad "no /bin/$p (the controller's directory command line needs it)"
  done
  for lib in usr/bin/llama-server $(images_llamacpp_backends "$flavor"); do
    [[ $lib == usr/* ]] || lib=$(cd "$rootfs" && find usr/lib -path "*/ggml/backends0/$lib" | head -1)
    [[ -n $lib ]] || { bad "ggml backend missing: $(images_llamacpp_backends "$flavor" | tr '\n' ' ')"; continue; }
    libs=$(chroot "$rootfs" /lib64/ld-linux-x86-64.so.2 --list "/$lib" 2>&1) || true
    if grep -q 'not found' <<<"$libs" || ! grep -q 'libc.so.6' <<<"$libs"; then bad "/$lib dependencies: $(grep 'not found' <<<"$libs" | head -5)"
    else ok "/$lib: $(wc -l <<<"$libs") libraries resolved in the image"; fi
  done
  if [[ $flavor == vulkan ]]; then
    # AMD cards: Mesa's radv, found by the Vulkan loader through its ICD manifest
    # (manifest: /usr/share/vulkan/icd.d/radeon_icd.json, library_path a file name the loader looks up)
    lib=$(jq -r '.ICD.library_path // empty' "$rootfs/usr/share/vulkan/icd.d/radeon_icd.json" 2>/dev/null || true)
    [[ -z $lib || $lib == /* ]] || lib=/$(cd "$rootfs" && find usr/lib -name "$lib" | head -1)
    libs=""
    [[ -z $lib || ! -e $rootfs$lib ]] || libs=$(chroot "$rootfs" /lib64/ld-linux-x86-64.so.2 --list "$lib" 2>&1 || true)
    if [[ -n $libs ]] && ! grep -q 'not found' <<<"$libs"; then
      ok "Vulkan ICD radeon_icd.json (radv): $lib, $(wc -l <<<"$libs") libraries resolved in the image"
    else bad "Vulkan ICD radeon_icd.json: library '$lib' missing or unresolved: $(grep 'not found' <<<"$libs" | head -3)"; fi
  fi
  o=$(env -i PATH=/usr/bin:/bin HOME=/tmp /usr/sbin/chroot --userspec=65532:65532 "$rootfs" /app/llama-server --version 2>&1) \
    && [[ $o == *"version: "* ]] && ok "chroot 65532: llama-server --version: $(head -1 <<<"$o")" || bad "llama-server --version: $o"
  o=$(env -i PATH=/usr/bin:/bin HOME=/tmp /usr/sbin/chroot --userspec=65532:65532 "$rootfs" /app/llama-server --list-devices 2>&1) \
    && ok "chroot 65532: llama-server --list-devices: $(grep -v '^Available devices' <<<"$o" | sed 's/^ *//' | paste -sd';' -)" || bad "llama-server --list-devices: $o"

  if ! o=$(llamacpp_model); then bad "no GGUF to serve: $o"; return; fi
  [[ -z $o ]] || echo "  gguf  $o"
  mkdir -p "$rootfs/models"
  port=$((18000 + RANDOM % 1000))
  # The controller's command line for a directory source (crates/flexinfer-controller/src/model/backends.rs).
  # shellcheck disable=SC2016
  unshare --mount --propagation private -- /bin/sh -c '
    r=$1 m=$2; shift 2
    mount --bind "$r" "$r" && mount -o remount,bind,ro "$r" && mount -t proc proc "$r/proc" \
      && mount -t tmpfs -o mode=1777 tmpfs "$r/tmp" && mount --bind "$m" "$r/models" && mount -o remount,bind,ro "$r/models" \
      && exec env -i PATH=/usr/bin:/bin HOME=/tmp /usr/sbin/chroot --userspec=65532:65532 "$r" "$@"' \
    sh "$rootfs" "$tmp/models" /bin/sh -c 'exec /app/llama-server --model "$(find /models -name '"'*.gguf'"' | sort | head -n 1)" "$@"' \
    llama-server --host 127.0.0.1 --port "$port" --alias tiny --n-gpu-layers 999 > "$tmp/llama-server-$flavor.log" 2>&1 &
  srv=$!
  health=""
  for i in $(seq 120); do
    health=$(curl -fsS "http://127.0.0.1:$port/health" 2>/dev/null) && break
    kill -0 "$srv" 2>/dev/null || break
    sleep 0.5
  done
  if [[ $health == *'"ok"'* ]]; then
    ok "llama-server (65532, read-only root) serves /models: GET /health $health after $((i / 2)) s"
    reply=$(curl -sS --max-time 60 "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
      -d '{"model":"tiny","messages":[{"role":"user","content":"hello"}],"max_tokens":8,"temperature":0}' 2>&1) || true
    content=$(jq -r '.choices[0].message.content // empty' <<<"$reply" 2>/dev/null)
    if [[ -n $content && $(jq -r .model <<<"$reply") == tiny ]]; then
      ok "POST /v1/chat/completions: $(jq -c '{model, content: .choices[0].message.content, finish: .choices[0].finish_reason, usage: .usage.completion_tokens}' <<<"$reply")"
    else bad "POST /v1/chat/completions: $reply"; fi
    o=$(grep -m1 -o 'loading model .*' "$tmp/llama-server-$flavor.log" || true)
    [[ -n $o ]] && ok "its log: $o" || bad "llama-server log names no model: $(tail -3 "$tmp/llama-server-$flavor.log")"
  else
    bad "llama-server: no /health: $(tail -5 "$tmp/llama-server-$flavor.log")"
  fi
  kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null || true
}

for unit in "${images[@]}"; do
  img=${unit%@*} itag=${itags[$unit]} variant=${ivariant[$unit]:-}
  archive=$out/flexinfer-$img-$itag.tar
  [[ -s $archive ]] || { echo "  skip  $archive missing (run scripts/images/build.sh first)"; continue; }
  checked=$((checked + 1))
  echo "flexinfer/$img:$itag ($archive)"
  cfg=$(skopeo inspect --config "docker-archive:$archive")
  user=$(jq -r '.config.User' <<<"$cfg")
  ep=$(jq -c '.config.Entrypoint' <<<"$cfg")
  [[ $user == 65532:65532 ]] && ok "user $user" || bad "user $user (want 65532:65532)"
  [[ $ep == "[\"${entry[$img]}\"]" ]] && ok "entrypoint $ep" || bad "entrypoint $ep (want [\"${entry[$img]}\"])"
  if [[ $img == worker ]]; then
    sv=$(jq -r '.config.Labels["dev.flexinfer.script-version"] // ""' <<<"$cfg")
    [[ $sv =~ ^v[0-9]+$ ]] && ok "label dev.flexinfer.script-version=$sv" || bad "label dev.flexinfer.script-version '$sv'"
  fi

  bd=bundle-${unit/@/-}
  skopeo copy --quiet "docker-archive:$archive" "oci:$tmp/oci-$img:$itag"
  umoci unpack --image "$tmp/oci-$img:$itag" "$tmp/$bd" >/dev/null
  rootfs=$tmp/$bd/rootfs
  if [[ $img == llamacpp ]]; then
    check_llamacpp "${variant:-cpu}" "$rootfs" "$cfg"
  elif [[ -n $variant ]]; then
    lv=$(jq -r '.config.Labels["dev.flexinfer.variant"] // ""' <<<"$cfg")
    lr=$(jq -r '.config.Labels["dev.flexinfer.runtime"] // ""' <<<"$cfg")
    [[ $lv == "$variant" ]] && ok "label dev.flexinfer.variant=$lv" || bad "label dev.flexinfer.variant '$lv' (want $variant)"
    read -r rpkg soname <<<"$(images_variant_runtime "$variant")"
    [[ $lr == "$rpkg="?* ]] && ok "label dev.flexinfer.runtime=$lr" || bad "label dev.flexinfer.runtime '$lr' (want $rpkg=<version>)"
    lm=$(jq -r '.config.Labels["dev.flexinfer.math"] // ""' <<<"$cfg")
    want_math=$(images_variant_math "$variant" | awk '{print $1}' | paste -sd, -)
    [[ $(sed -E 's/=[^,]*//g' <<<"$lm") == "$want_math" ]] && ok "label dev.flexinfer.math=$lm" \
      || bad "label dev.flexinfer.math '$lm' (want $want_math with versions)"
    for so in "$soname" $(images_variant_math "$variant" | awk '{print $2}'); do
      lib=$(cd "$rootfs" && find usr/lib -name "$so" 2>/dev/null | head -1 || true)
      if [[ -z $lib ]]; then bad "$so not in the image"; continue; fi
      libs=$(chroot "$rootfs" /lib64/ld-linux-x86-64.so.2 --list "/$lib" 2>&1) || true
      if grep -q 'not found' <<<"$libs" || ! grep -q 'libc.so.6' <<<"$libs"; then bad "/$lib dependencies: $libs"
      else ok "/$lib -> $(readlink -f "$rootfs/$lib" | sed "s|^$rootfs||"), $(wc -l <<<"$libs") libraries resolved in the image: $(awk '{print $1}' <<<"$libs" | grep -v '^/' | tr '\n' ' ')"; fi
    done
    cuda=$(cd "$rootfs" && find . -name 'libcuda.so*' 2>/dev/null | head -3 | tr '\n' ' ' || true)
    [[ -z $cuda ]] && ok "no libcuda.so* in the image (the host driver's is mounted at run time)" || bad "libcuda in the image: $cuda"
    gfx=$(images_variant_gfx "$variant")
    [[ ! -e $rootfs/usr/lib/flexinfer/kernels ]] && ok "no code object files (the binary embeds them)" \
      || bad "/usr/lib/flexinfer/kernels in the image (code objects are embedded in the binary now)"
    if [[ -n $gfx ]]; then
      lc=$(jq -r '.config.Labels["dev.flexinfer.hip-code-object"] // ""' <<<"$cfg")
      dev=$(chroot --userspec=65532:65532 "$rootfs" /usr/local/bin/flexinfer-worker devices 2>&1) || dev=""
      emb=$(jq -r --arg g "$gfx" '.hipCodeObjects.embedded[]? | select(.target == $g) | "\(.target) sha256:\(.sha256)"' <<<"$dev" 2>/dev/null || true)
      if [[ -n $emb && $emb == "$lc" ]]; then
        ok "flexinfer-worker embeds gptq-$gfx.hsaco ($(jq -r --arg g "$gfx" '.hipCodeObjects.embedded[] | select(.target == $g) | .bytes' <<<"$dev") bytes), as the label says: $lc"
      else bad "flexinfer-worker devices: embedded '$emb', label dev.flexinfer.hip-code-object '$lc' (want $gfx, equal)"; fi
    fi
  fi
  [[ $(jq -r '.process.user | "\(.uid):\(.gid)"' "$tmp/$bd/config.json") == 65532:65532 ]] \
    && ok "umoci bundle runs as 65532:65532" || bad "umoci bundle user"
  for b in ${helps[$unit]}; do
    if [[ ! -e $rootfs/usr/local/bin/$b ]]; then
      [[ $b == flexinfer-standin ]] && { ok "$b not in the image (not built)"; continue; }
      bad "$b missing"; continue
    fi
    libs=$(chroot "$rootfs" /lib64/ld-linux-x86-64.so.2 --list "/usr/local/bin/$b" 2>&1) || true
    if grep -q 'not found' <<<"$libs" || ! grep -q 'libc.so.6' <<<"$libs"; then bad "$b shared libraries: $libs"
    else ok "$b libraries: $(awk '{print $1}' <<<"$libs" | grep -v '^/' | tr '\n' ' ')"; fi
    if o=$(chroot --userspec=65532:65532 "$rootfs" "/usr/local/bin/$b" --help 2>&1); then
      ok "chroot 65532: $b --help: $(head -1 <<<"$o")"
    elif ran "$b" "$o"; then
      ok "chroot 65532: $b ran (no --help; its own message: $(head -1 <<<"$o"))"
    else bad "chroot 65532: $b --help failed: $(tail -3 <<<"$o")"; fi
  done
  if command -v runc >/dev/null; then
    jq --arg b "${entry[$img]}" '.process.args=[$b,"--help"] | .process.terminal=false' \
      "$tmp/$bd/config.json" > "$tmp/config.json" && mv "$tmp/config.json" "$tmp/$bd/config.json"
    if o=$(cd "$tmp/$bd" && timeout 60 runc --root "$tmp/runc" run "fi-verify-${unit/@/-}-$$" 2>&1); then
      ok "runc (uid 65532, own netns): ${entry[$img]##*/} --help: $(head -1 <<<"$o")"
    elif ran "${entry[$img]##*/}" "$o"; then
      ok "runc (uid 65532, own netns): ${entry[$img]##*/} ran: $(head -1 <<<"$o")"
    else
      echo "  skip  runc here: $(tail -1 <<<"$o")"
    fi
  fi
done

# 3. loopback registry round trip
if command -v docker-registry >/dev/null; then
  port=$((15000 + RANDOM % 1000))
  cat > "$tmp/registry.yml" <<R
version: 0.1
log: {level: warn}
storage: {filesystem: {rootdirectory: $tmp/registry}, delete: {enabled: true}}
http: {addr: 127.0.0.1:$port}
R
  docker-registry serve "$tmp/registry.yml" > "$tmp/registry.log" 2>&1 &
  reg_pid=$!
  for _ in $(seq 50); do curl -fsS "http://127.0.0.1:$port/v2/" >/dev/null 2>&1 && break; sleep 0.2; done
  reg=127.0.0.1:$port
  echo "registry $reg (pid $reg_pid)"
  for unit in "${images[@]}"; do
    img=${unit%@*} itag=${itags[$unit]}
    archive=$out/flexinfer-$img-$itag.tar
    [[ -s $archive ]] || continue
    dest=docker://$reg/flexinfer/$img:$itag
    skopeo copy --quiet --dest-tls-verify=false "docker-archive:$archive" "$dest"
    pushed=$(skopeo inspect --tls-verify=false --format '{{.Digest}}' "$dest")
    # dir: keeps the registry's manifest byte for byte (oci: would convert it to OCI)
    skopeo copy --quiet --src-tls-verify=false "$dest" "dir:$tmp/back-$img-$itag"
    back=sha256:$(images_sha256 < "$tmp/back-$img-$itag/manifest.json")
    c0=$(skopeo inspect --raw "docker-archive:$archive" | jq -r .config.digest)
    c1=$(skopeo inspect --raw --tls-verify=false "$dest" | jq -r .config.digest)
    c2=$(jq -r .config.digest "$tmp/back-$img-$itag/manifest.json")
    [[ $pushed == "$back" ]] && ok "$img: pushed $reg/flexinfer/$img:$itag @ $pushed, copied back: same manifest digest" \
      || bad "$img: pushed $pushed, copied back $back"
    [[ $c0 == "$c1" && $c1 == "$c2" ]] && ok "$img: same config (image id) archive/registry/copy: $c0" \
      || bad "$img: config digests $c0 / $c1 / $c2"
  done
else
  echo "  skip  registry round trip: docker-registry not installed"
fi

# 4. containerd import, as load-image.sh does on the test node
if command -v containerd >/dev/null && command -v ctr >/dev/null; then
  mkdir -p "$tmp/ctrd"
  cat > "$tmp/ctrd/config.toml" <<C
version = 2
root = "$tmp/ctrd/root"
state = "$tmp/ctrd/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$tmp/ctrd/sock"
[ttrpc]
  address = "$tmp/ctrd/sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
C
  containerd --config "$tmp/ctrd/config.toml" > "$tmp/ctrd/log" 2>&1 &
  ctrd_pid=$!
  c() { ctr --address "$tmp/ctrd/sock" --namespace flexinfer-verify "$@"; }
  for _ in $(seq 50); do c version >/dev/null 2>&1 && break; sleep 0.2; done
  for unit in "${images[@]}"; do
    img=${unit%@*} itag=${itags[$unit]}
    archive=$out/flexinfer-$img-$itag.tar
    [[ -s $archive ]] || continue
    if ! o=$(c images import "$archive" 2>&1); then bad "ctr images import $img: $o"; continue; fi
    name=$(c images ls -q | grep -x "docker.io/flexinfer/$img:$itag" || true)
    [[ $name == "docker.io/flexinfer/$img:$itag" ]] && ok "ctr images import: $name" || bad "ctr import named it '$name'"
    if o=$(timeout 60 ctr --address "$tmp/ctrd/sock" --namespace flexinfer-verify run --rm "$name" "fi-verify-${unit/@/-}-$$" "${entry[$img]}" --help 2>&1); then
      ok "ctr run (image user 65532): ${entry[$img]##*/} --help: $(head -1 <<<"$o")"
    elif ran "${entry[$img]##*/}" "$o"; then
      ok "ctr run (image user 65532): ${entry[$img]##*/} ran: $(head -1 <<<"$o")"
    else
      echo "  skip  ctr run here: $(tail -1 <<<"$o")"
    fi
  done
fi

((checked > 0)) || bad "no archive in $out for tag $tag"
((fail == 0)) && echo "verify: all checks passed" || { echo "verify: FAILED"; exit 1; }
