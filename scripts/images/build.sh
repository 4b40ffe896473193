#!/usr/bin/env bash
# Build the FlexInfer container images locally, daemonless and without pulling from any registry:
# the base comes from Debian packages (scripts/images/base.sh, cached), the binaries are the ones
# already built (no compile in the image), buildah builds the Dockerfiles' `runtime-prebuilt` target.
# The llama.cpp serving images hold no FlexInfer binary: Debian sid's llama-server, its whole root built
# from packages by scripts/images/base-llamacpp.sh.
#
#   bash scripts/images/build.sh [--bin-dir DIR] [--tag TAG] [--out DIR] [--push REGISTRY] [--load]
#                                [--only IMAGE]... [--variant V]... [--no-strip]
#     --bin-dir DIR   where flexinfer-controller, flexinfer, flexinfer-worker (and flexinfer-standin,
#                     if built) are; default ${CARGO_TARGET_DIR:-~/.cache/flexinfer/target}/debug
#     --tag TAG       image tag; default dev
#     --out DIR       archives (docker-archive, importable with `ctr images import`, `docker load`,
#                     skopeo); default $FLEXINFER_IMAGES_CACHE/out
#     --push REG      also push to REG (host:port, plain http) as REG/flexinfer/<image>:TAG (variants: TAG-V)
#     --load          also import into the test node's containerd (scripts/testenv/load-image.sh)
#     --only NAME     build one image (repeatable): controller, worker, standin (the serving stand-in,
#                     build/standin.Dockerfile; built by default when flexinfer-standin is in --bin-dir),
#                     proxy (the gateway, build/proxy.Dockerfile; built by default when flexinfer-proxy
#                     is in --bin-dir), llamacpp (Debian sid's llama-server, CPU backends; built by
#                     default), llamacpp-vulkan (+ ggml's Vulkan backend and Mesa's drivers), llamacpp-rocm
#                     (+ ggml's HIP backend, ROCm and rocBLAS: ~5.5 GB; the GPU flavors only on request)
#     --variant V     build the worker image's variant V (repeatable): cpu, cuda, rocm-gfx1100, rocm-gfx906
#                     (scripts/images/variants.sh), tagged TAG-V (cpu: TAG, the default worker image); with
#                     --variant and no --only, only the worker is built. Each variant's base is built by
#                     base.sh from its own package list and cached like the default base (the two ROCm
#                     variants share one)
#     --no-strip      keep debug info (by default binaries are copied with `strip --strip-debug`:
#                     symbols, hence backtraces, stay)
# Images: flexinfer/controller:TAG, flexinfer/worker:TAG, flexinfer/standin:TAG, flexinfer/proxy:TAG,
# flexinfer/llamacpp:TAG (archives tagged like that; the local store names them localhost/flexinfer/<image>:TAG);
# the worker's variants flexinfer/worker:TAG-V; the llama.cpp flavors flexinfer/llamacpp:TAG-vulkan and
# flexinfer/llamacpp:TAG-rocm. The llama.cpp images carry dev.flexinfer.llamacpp (the llama.cpp-tools and libggml0
# versions), the GPU flavors dev.flexinfer.variant and dev.flexinfer.runtime (mesa-vulkan-drivers,
# libamdhip64-6), rocm also dev.flexinfer.math (rocBLAS, hipBLAS) and dev.flexinfer.gfx-targets (the AMD
# targets ggml's HIP backend has code for, read from the library when the base is built). Worker
# images carry the label dev.flexinfer.script-version (`flexinfer-worker version`, the contract version the
# controller's FLEXINFER_SCRIPT_VERSION must match), GPU variants dev.flexinfer.variant and
# dev.flexinfer.runtime (the runtime package and version). The ROCm variants need a flexinfer-worker that embeds
# the HIP code object of their target (built with FLEXINFER_HIP_CODE_OBJECTS set, crates/flexinfer-quant/
# build.rs; `make worker-images` builds it so); the build stops naming the command otherwise, and the variant
# gets the label dev.flexinfer.hip-code-object (target and SHA-256). An image whose inputs (binaries, Dockerfile,
# base, this script) are unchanged is not rebuilt: a key file sits next to each archive.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=scripts/images/lib.sh
. "$here/lib.sh"
# shellcheck source=scripts/images/variants.sh
. "$here/variants.sh"

bin_dir=${CARGO_TARGET_DIR:-$HOME/.cache/flexinfer/target}/debug # the default of .ci/run and scripts/demo.sh
tag=dev
out=$FLEXINFER_IMAGES_CACHE/out
push=""
load=0
strip=1
only=()
variants=()
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }
while (($#)); do
  case $1 in
    --bin-dir) bin_dir=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --push) push=${2%/}; push=${push#http://}; shift 2 ;;
    --load) load=1; shift ;;
    --only) only+=("$2"); shift 2 ;;
    --variant) variants+=("$2"); shift 2 ;;
    --no-strip) strip=0; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; images_die "unknown argument: $1" ;;
  esac
done
[[ $tag =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || images_die "bad tag: $tag"
for v in "${variants[@]}"; do
  images_variant_valid "$v" || images_die "--variant: no variant $v (${IMAGES_VARIANTS[*]})"
  [[ $(images_variant_tag "$tag" "$v") =~ ^.{1,128}$ ]] || images_die "tag too long for --variant $v: $tag"
done
for t in buildah skopeo jq; do command -v $t >/dev/null || images_die "$t not installed (apt-get install $t)"; done
mkdir -p "$out"
out=$(cd "$out" && pwd)
# Image timestamps: fixed, so the same inputs give the same digest (set SOURCE_DATE_EPOCH to change).
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1735689600}
export SOURCE_DATE_EPOCH

exec 8>"$FLEXINFER_IMAGES_CACHE/.build.lock"
flock 8

t_start=$(date +%s)
declare -A t_step=()

# image -> binaries (a trailing ? marks an optional one)
# (the llama.cpp images: none; their Dockerfile is build/llamacpp.Dockerfile for every flavor)
declare -A bins=([controller]="flexinfer-controller flexinfer" [worker]="flexinfer-worker flexinfer-standin?"
  [standin]="flexinfer-standin" [proxy]="flexinfer-proxy" [llamacpp]="" [llamacpp-vulkan]="" [llamacpp-rocm]="")
dockerfile_of() { echo "$root/build/${1%%-*}.Dockerfile"; } # llamacpp-rocm -> llamacpp.Dockerfile
images=(controller worker llamacpp)
if ((${#variants[@]})) && ! ((${#only[@]})); then
  images=(worker)
elif ((${#only[@]})); then
  for n in "${only[@]}"; do
    [[ -n ${bins[$n]+set} && -f $(dockerfile_of "$n") ]] \
      || images_die "--only: no image $n (controller, worker, standin, proxy, llamacpp, llamacpp-vulkan, llamacpp-rocm)"
  done
  images=("${only[@]}")
else
  # The serving stand-in's and the gateway's own images, when their binaries have been built.
  for img in standin proxy; do
    [[ -f $root/build/$img.Dockerfile ]] || continue
    if [[ -x $bin_dir/flexinfer-$img ]]; then images+=("$img")
    else images_log "$img: $bin_dir/flexinfer-$img not built, no flexinfer/$img image"; fi
  done
fi

# Binaries first: fail before the base build if one is missing.
for img in "${images[@]}"; do
  [[ -z ${bins[$img]} ]] && continue
  d=$(cd "$bin_dir" 2>/dev/null && pwd) || images_die "no such --bin-dir: $bin_dir"
  bin_dir=$d
  break
done
declare -A files=()
for img in "${images[@]}"; do
  list=()
  for b in ${bins[$img]}; do
    opt=0; [[ $b == *\? ]] && { opt=1; b=${b%\?}; }
    if [[ -x $bin_dir/$b && -f $bin_dir/$b ]]; then list+=("$b")
    elif ((opt)); then images_log "$img: $b not in $bin_dir, image without it"
    else images_die "$img: $bin_dir/$b missing (cargo build -p flexinfer-worker -p flexinfer-controller -p flexinfer-cli)"
    fi
  done
  files[$img]=${list[*]}
done

# Build units: image[@variant]; the worker's variants replace the plain worker when --variant is given
# (variant cpu is the plain worker); llamacpp-F is llamacpp@F.
units=()
for img in "${images[@]}"; do
  if [[ $img == llamacpp-* ]]; then
    files[llamacpp]=""
    [[ " ${units[*]} " == *" llamacpp@${img#llamacpp-} "* ]] || units+=("llamacpp@${img#llamacpp-}")
  elif [[ $img == worker ]] && ((${#variants[@]})); then
    for v in "${variants[@]}"; do
      u=worker@$v
      [[ $v == cpu ]] && u=worker # the plain worker image, built exactly as without --variant
      [[ " ${units[*]} " == *" $u "* ]] || units+=("$u")
    done
  else
    units+=("$img")
  fi
done

# The contract version, baked into the worker images as a label.
script_version=""
if [[ -n ${files[worker]:-} ]]; then
  script_version=$("$bin_dir/flexinfer-worker" version 2>/dev/null) || script_version=""
  [[ $script_version =~ ^v[0-9]+$ ]] || { images_log "worker: \`flexinfer-worker version\` gave '$script_version', no script-version label"; script_version=""; }
fi

# The ROCm variants: the worker binary must embed their target's HIP code object (`flexinfer-worker devices`
# lists what it embeds, with each object's SHA-256).
declare -A embedded=()
if [[ " ${units[*]} " == *" worker@rocm-"* ]]; then
  devices=$("$bin_dir/flexinfer-worker" devices 2>/dev/null) || images_die "\`$bin_dir/flexinfer-worker devices\` failed"
  while read -r t h; do embedded[$t]=$h; done < <(jq -r '.hipCodeObjects.embedded[] | "\(.target) \(.sha256)"' <<<"$devices")
  have=${!embedded[*]}
  for u in "${units[@]}"; do
    [[ $u == worker@rocm-* ]] || continue
    g=$(images_variant_gfx "${u#worker@}")
    [[ -n ${embedded[$g]:-} ]] || images_die "$u: $bin_dir/flexinfer-worker embeds no $g HIP code object (it embeds: ${have:-none}); build it with: FLEXINFER_HIP_CODE_OBJECTS=\$(bash scripts/hip/build-code-objects.sh) cargo build -p flexinfer-worker (or make worker-images)"
  done
fi

# Bases: the default one, and one per distinct variant recipe (base.sh caches each).
declare -A bases=() base_ids=() base_pkgs=() base_of_env=()
base_for() { # base_for VARIANT -> sets the base of that variant in bases[VARIANT] (cpu: the default base)
  local v=$1 envs=() line
  while IFS= read -r line; do [[ -n $line ]] && envs+=("$line"); done < <(images_variant_base_env "$v")
  # variants with the same recipe share one base.sh run (BASE_REBUILD=1 rebuilds it once)
  local k="recipe ${envs[*]}" # never empty (the default recipe has no lines)
  [[ -n ${base_of_env[$k]:-} ]] || base_of_env[$k]=$(env "${envs[@]}" bash "$here/base.sh")
  bases[$v]=${base_of_env[$k]}
  base_ids[$v]=$(bah inspect --type image --format '{{.FromImageID}}' "${bases[$v]}")
  local id=${bases[$v]##*:}
  base_pkgs[$v]=$FLEXINFER_IMAGES_CACHE/base-$id.packages
}
# The llama.cpp flavors' bases (base-llamacpp.sh), keyed by the unit: llamacpp, llamacpp@vulkan, llamacpp@rocm.
llamacpp_base_for() {
  local u=$1 flavor=cpu
  [[ $u == *@* ]] && flavor=${u#*@}
  bases[$u]=$(LLAMACPP_FLAVOR=$flavor bash "$here/base-llamacpp.sh")
  base_ids[$u]=$(bah inspect --type image --format '{{.FromImageID}}' "${bases[$u]}")
  base_pkgs[$u]=$FLEXINFER_IMAGES_CACHE/base-${bases[$u]##*:}.packages
}
base_key() { # base_key UNIT -> the key of its base in bases[]
  if [[ ${1%@*} == llamacpp ]]; then echo "$1"
  elif [[ $1 == *@* ]]; then echo "${1#*@}"
  else echo cpu; fi
}
t0=$(date +%s)
for u in "${units[@]}"; do
  k=$(base_key "$u")
  [[ -n ${bases[$k]:-} ]] && continue
  if [[ ${u%@*} == llamacpp ]]; then llamacpp_base_for "$u"; else base_for "$k"; fi
done
base=${bases[cpu]:-}
t_step[base]=$(($(date +%s) - t0))

# sha256 of a binary, remembered by path, size, mtime and inode (hashing ~600 MB of dev binaries
# would otherwise be most of a run where nothing changed).
hash_cache=$FLEXINFER_IMAGES_CACHE/.bin-sha256
bin_sha256() {
  local stamp h
  stamp="$1 $(stat -c '%s %Y %i' "$1")"
  h=$(awk -v s="$stamp" 'substr($0, 1, length(s) + 1) == s " " { print $NF }' "$hash_cache" 2>/dev/null | tail -1)
  if [[ -z $h ]]; then
    h=$(images_sha256 < "$1")
    { grep -v "^$1 " "$hash_cache" 2>/dev/null || true; echo "$stamp $h"; } > "$hash_cache.new"
    mv "$hash_cache.new" "$hash_cache"
  fi
  echo "$h"
}

summary=()
for unit in "${units[@]}"; do
  t0=$(date +%s)
  img=${unit%@*}
  variant=""; [[ $unit == *@* ]] && variant=${unit#*@}
  dockerfile=$(dockerfile_of "$img")
  itag=$tag
  [[ -n $variant ]] && itag=$(images_variant_tag "$tag" "$variant")
  ref=flexinfer/$img:$itag
  archive=$out/flexinfer-$img-$itag.tar
  bkey=$(base_key "$unit")
  ubase=${bases[$bkey]} ubase_id=${base_ids[$bkey]}
  # Labels and build arguments beyond the common ones.
  extra=() gfx=""
  if [[ $img == worker && -n $script_version ]]; then
    extra+=(--label "dev.flexinfer.script-version=$script_version")
  fi
  if [[ $img == llamacpp ]]; then
    while read -r label pkgs; do
      val=""
      for p in $pkgs; do
        ver=$(awk -v p="$p" '$1 == p { print $2 }' "${base_pkgs[$bkey]}" 2>/dev/null)
        [[ -n $ver ]] || images_die "$unit: $p not in the base $ubase (${base_pkgs[$bkey]})"
        val+="${val:+,}$p=$ver"
      done
      extra+=(--label "dev.flexinfer.$label=$val")
    done < <(images_llamacpp_labels "${variant:-cpu}")
    [[ -z $variant ]] || extra+=(--label "dev.flexinfer.variant=$variant")
    gfx_file=${base_pkgs[$bkey]%.packages}.gfx-targets
    if [[ $variant == rocm ]]; then
      [[ -s $gfx_file ]] || images_die "$unit: no gfx target list $gfx_file (BASE_REBUILD=1 LLAMACPP_FLAVOR=rocm bash $here/base-llamacpp.sh)"
      extra+=(--label "dev.flexinfer.gfx-targets=$(paste -sd, "$gfx_file")")
    fi
  elif [[ -n $variant && $variant != cpu ]]; then
    extra+=(--label "dev.flexinfer.variant=$variant")
    read -r rpkg _ <<<"$(images_variant_runtime "$variant")"
    rver=$(awk -v p="$rpkg" '$1 == p { print $2 }' "${base_pkgs[$variant]}" 2>/dev/null)
    [[ -n $rver ]] || images_die "$unit: $rpkg not in the base ${ubase} (${base_pkgs[$variant]})"
    extra+=(--label "dev.flexinfer.runtime=$rpkg=$rver")
    math=""
    while read -r mpkg _; do
      [[ -n $mpkg ]] || continue
      mver=$(awk -v p="$mpkg" '$1 == p { print $2 }' "${base_pkgs[$variant]}" 2>/dev/null)
      [[ -n $mver ]] || images_die "$unit: $mpkg not in the base ${ubase} (${base_pkgs[$variant]})"
      math+="${math:+,}$mpkg=$mver"
    done < <(images_variant_math "$variant")
    [[ -z $math ]] || extra+=(--label "dev.flexinfer.math=$math")
    gfx=$(images_variant_gfx "$variant")
    [[ -z $gfx ]] || extra+=(--label "dev.flexinfer.hip-code-object=$gfx sha256:${embedded[$gfx]}")
  fi
  key=$(
    {
      echo "dockerfile $(images_sha256 < "$dockerfile")"
      if [[ -n $variant || $img == llamacpp ]]; then
        echo "script $(cat "$here/build.sh" "$here/lib.sh" "$here/variants.sh" | images_sha256)"
      else
        echo "script $(cat "$here/build.sh" "$here/lib.sh" | images_sha256)"
      fi
      echo "base $ubase $ubase_id"
      echo "epoch $SOURCE_DATE_EPOCH strip $strip ref $ref"
      for b in ${files[$img]}; do echo "bin $b $(bin_sha256 "$bin_dir/$b")"; done
      echo "extra ${extra[*]}"
    } | images_sha256
  )
  if [[ -s $archive && -f $archive.info && -f $archive.key && $(cat "$archive.key") == "$key" ]]; then
    images_log "$unit: inputs unchanged, keeping $archive"
    status=cached
  else
    images_log "$unit: building $ref (${files[$img]:-no FlexInfer binary}${gfx:+, embedding gptq-$gfx.hsaco}) on $ubase"
    rm -f "$archive.key" "$archive.info"
    ctx=$(mktemp -d "$FLEXINFER_IMAGES_CACHE/.ctx-XXXXXX")
    trap 'rm -rf "$ctx"' EXIT
    mkdir "$ctx/bin"
    for b in ${files[$img]}; do
      if ((strip)); then strip --strip-debug -o "$ctx/bin/$b" "$bin_dir/$b"
      else cp "$bin_dir/$b" "$ctx/bin/$b"; fi
      chmod 0755 "$ctx/bin/$b"
    done
    bah bud --quiet --isolation chroot --pull=never --timestamp "$SOURCE_DATE_EPOCH" \
      --identity-label=false --target runtime-prebuilt \
      --build-arg "BASE=$ubase" --build-arg BIN_DIR=bin \
      --label "org.opencontainers.image.title=flexinfer-$img" \
      --label "org.opencontainers.image.version=$itag" \
      --label "dev.flexinfer.base=$ubase" "${extra[@]}" \
      -f "$dockerfile" -t "localhost/$ref" "$ctx" >/dev/null
    rm -rf "$ctx"
    trap - EXIT
    rm -f "$archive"
    # skopeo, not `buildah push`: that would add the store's localhost/ name to the archive's tags.
    skopeo copy --quiet "$(images_storage_ref)localhost/$ref" "docker-archive:$archive:$ref"
    # image id and size, so that a cached run need not read the archive
    printf '%s %s\n' "$(skopeo inspect --raw "docker-archive:$archive" | jq -r .config.digest)" \
      "$(bah images --format '{{.Size}}' "localhost/$ref" | tr -d ' ')" > "$archive.info"
    echo "$key" > "$archive.key"
    status=built
  fi
  read -r id size < "$archive.info" || { id="sha256:?" size="?"; }
  t_step[$unit]=$(($(date +%s) - t0))
  line="$ref  $status  image $size, archive $(images_size "$archive")  id ${id:7:12}  $archive  (${t_step[$unit]} s)"

  if [[ -n $push ]]; then
    t0=$(date +%s)
    dest=docker://$push/flexinfer/$img:$itag
    images_log "$unit: pushing to $dest"
    skopeo copy --quiet --dest-tls-verify=false "docker-archive:$archive" "$dest"
    pushed=$(skopeo inspect --tls-verify=false --format '{{.Digest}}' "$dest")
    line+=$'\n'"    pushed $push/flexinfer/$img:$itag @ $pushed ($(($(date +%s) - t0)) s)"
  fi
  if ((load)); then
    loader=$root/scripts/testenv/load-image.sh
    if [[ -f $loader ]]; then
      t0=$(date +%s)
      images_log "$unit: loading into the test node: $loader $archive $ref"
      bash "$loader" "$archive" "$ref"
      line+=$'\n'"    loaded into the test node ($(($(date +%s) - t0)) s)"
    else
      images_log "$unit: --load skipped: $loader does not exist yet"
      line+=$'\n'"    --load skipped (no scripts/testenv/load-image.sh)"
    fi
  fi
  summary+=("$line")
done

bah rmi --prune >/dev/null 2>&1 || true # the images these tags pointed to before
if [[ -n $base ]]; then
  echo "base   $base  ($(images_size "$FLEXINFER_IMAGES_CACHE/base-${base##*:}.tar" 2>/dev/null || echo ?) rootfs, ${t_step[base]} s)"
fi
for v in "${variants[@]}"; do
  [[ $v == cpu ]] && continue
  echo "base   ${bases[$v]}  ($(images_size "$FLEXINFER_IMAGES_CACHE/base-${bases[$v]##*:}.tar" 2>/dev/null || echo ?) rootfs) for $v"
done
for u in "${units[@]}"; do
  [[ ${u%@*} == llamacpp ]] || continue
  echo "base   ${bases[$u]}  ($(images_size "$FLEXINFER_IMAGES_CACHE/base-${bases[$u]##*:}.tar.zst" 2>/dev/null || echo ?) rootfs, zstd) for $u"
done
[[ -n $base ]] || echo "bases  ${t_step[base]} s"
for l in "${summary[@]}"; do echo "$l"; done
echo "total  $(($(date +%s) - t_start)) s"
