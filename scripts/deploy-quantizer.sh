#!/usr/bin/env bash
# Build the worker (quantizer) image, push it, point the GPUProfile(s) of one GPU architecture at it, and
# optionally move a running quantization onto it. `make deploy-quantizer QUANTIZER_ARCH=gfx1100 REGISTRY=…`.
#
#   scripts/deploy-quantizer.sh ARCH --registry REG [--variant V] [--tag TAG] [--format FMT] [-n NAMESPACE]
#                                    [--bin-dir DIR] [--restart NAMESPACE/CACHE] [--wait SECONDS] [--dry-run]
#     ARCH            the GPUProfiles whose spec.architecture is ARCH are updated (all namespaces, or -n's)
#     --registry REG  host[:port] the image is pushed to (plain http, as scripts/images/build.sh pushes)
#     --variant V     the worker image variant built (scripts/images/variants.sh); default from ARCH:
#                     gfx1100 -> rocm-gfx1100, gfx906 -> rocm-gfx906, sm_XX -> cuda; other AMD targets have
#                     no HIP code object and need it given (cpu, or rocm-gfx1100 with an HSA override)
#     --tag TAG       image tag; default <git short commit>[-dirty]; the image pushed is
#                     REG/flexinfer/worker:TAG-V (cpu: TAG, the plain worker image)
#     --format FMT    the spec.quantization.images key to set; default GPTQ
#     -n NAMESPACE    only GPUProfiles in NAMESPACE
#     --bin-dir DIR   the built binaries (default: build.sh's, the debug build of the workspace)
#     --restart NS/CACHE  annotate that ModelCache with flexinfer.ai/force-image-update=true so its running
#                     quantize Job is replaced by one on the new image even past the drift grace window; the
#                     script waits (--wait, default 300 s) for the Job to run the new image, then removes the
#                     annotation again
#     --dry-run       build and push nothing; print the variant and the image it would push and check every
#                     patch with a server-side dry run (the GPUProfiles and caches are not changed)
# The image reference written is pinned by digest (REG/flexinfer/worker:TAG-V@sha256:…), so the controller sees
# a new image even when a tag is reused. Every variant holds the one worker binary; which GPU runtime it can load
# depends on the variant's base (docs/user/install.md, "Worker image variants").
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
die() { echo "deploy-quantizer: $*" >&2; exit 2; }
say() { echo "deploy-quantizer: $*" >&2; }
# shellcheck source=scripts/images/variants.sh
. scripts/images/variants.sh
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

arch="" variant="" registry="" tag="" format=GPTQ ns="" bin_dir="" restart="" wait_s=300 dry=0
while (($#)); do
  case $1 in
    --registry) registry=${2:?}; shift 2 ;;
    --variant) variant=${2:?}; shift 2 ;;
    --tag) tag=${2:?}; shift 2 ;;
    --format) format=${2:?}; shift 2 ;;
    -n | --namespace) ns=${2:?}; shift 2 ;;
    --bin-dir) bin_dir=${2:?}; shift 2 ;;
    --restart | --restart-job) restart=${2:?}; shift 2 ;;
    --wait) wait_s=${2:?}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h | --help) usage; exit 0 ;;
    -*) usage >&2; die "unknown option: $1" ;;
    *) [[ -z $arch ]] || die "one architecture at a time (got '$arch' and '$1')"; arch=$1; shift ;;
  esac
done
[[ -n $arch ]] || { usage >&2; die "no architecture given (e.g. gfx1100)"; }
[[ $arch =~ ^(gfx[0-9a-f]{3,5}|sm_[0-9]{2,3}[a-z]?)$ ]] \
  || die "bad architecture '$arch': an AMD gfx target (gfx1100, gfx906, …) or an NVIDIA sm_XX target, as in GPUProfile spec.architecture"
if [[ -n $variant ]]; then
  images_variant_valid "$variant" || die "bad --variant '$variant' (${IMAGES_VARIANTS[*]})"
else
  variant=$(images_arch_variant "$arch") \
    || die "no worker image variant for $arch: HIP code objects are built for gfx1100 and gfx906 only; give --variant (${IMAGES_VARIANTS[*]})"
fi
[[ -n $registry ]] || die "--registry is required (where the cluster pulls images from)"
registry=${registry%/}; registry=${registry#http://}
[[ $format =~ ^(GPTQ|AWQ|GGUF|EXL2|FP8|COMPRESSED_TENSORS)$ ]] || die "bad --format '$format' (GPTQ, AWQ, GGUF, EXL2, FP8, COMPRESSED_TENSORS)"
[[ $wait_s =~ ^[0-9]{1,5}$ ]] || die "bad --wait '$wait_s' (seconds)"
if [[ -n $restart ]]; then
  [[ $restart =~ ^([a-z0-9][a-z0-9.-]{0,62})/([a-z0-9][a-z0-9.-]{0,252})$ ]] \
    || die "--restart wants NAMESPACE/CACHE, got '$restart'"
  restart_ns=${BASH_REMATCH[1]} restart_name=${BASH_REMATCH[2]}
fi
if [[ -z $tag ]]; then
  tag=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [[ -z $(git status --porcelain --untracked-files=no 2>/dev/null) ]] || tag="$tag-dirty"
fi
for t in kubectl jq; do command -v $t >/dev/null || die "$t not installed"; done

# 1. The GPUProfiles of ARCH.
scope=(-A)
if [[ -n $ns ]]; then scope=(-n "$ns"); fi
profiles=$(kubectl get gpuprofiles.ai.flexinfer "${scope[@]}" -o json \
  | jq -r --arg a "$arch" '.items[] | select(.spec.architecture == $a) | "\(.metadata.namespace)/\(.metadata.name)"')
if [[ -z $profiles ]]; then
  known=$(kubectl get gpuprofiles.ai.flexinfer "${scope[@]}" -o json \
    | jq -r '[.items[] | "\(.metadata.namespace)/\(.metadata.name)=\(.spec.architecture)"] | join(", ")')
  die "no GPUProfile with spec.architecture=$arch${ns:+ in namespace $ns} (found: ${known:-none})"
fi
if [[ -n $restart ]]; then
  kubectl get modelcache.ai.flexinfer -n "$restart_ns" "$restart_name" >/dev/null || die "--restart: no ModelCache $restart"
fi

# 2. Build and push (or, dry run, name what would be pushed).
repo=$registry/flexinfer/worker
itag=$(images_variant_tag "$tag" "$variant")
if ((dry)); then
  image=$repo:$itag
  say "dry run: would build and push $image (variant $variant for $arch: scripts/images/build.sh --only worker --variant $variant --tag $tag --push $registry)"
else
  command -v skopeo >/dev/null || die "skopeo not installed"
  say "building and pushing $repo:$itag (variant $variant for $arch)"
  bash scripts/images/build.sh --only worker --variant "$variant" --tag "$tag" --push "$registry" ${bin_dir:+--bin-dir "$bin_dir"} >&2
  # build.sh pushes over plain http; read the digest the same way.
  digest=$(skopeo inspect --tls-verify=false "docker://$repo:$itag" | jq -r .Digest)
  [[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || die "could not read the pushed image's digest ($repo:$itag): '$digest'"
  image=$repo:$itag@$digest
  say "pushed $image"
fi

# 3. Point the profiles at it.
patch=$(jq -cn --arg f "$format" --arg i "$image" '{spec: {quantization: {images: {($f): $i}}}}')
dry_flag=() note=""
if ((dry)); then dry_flag=(--dry-run=server) note=" (server-side dry run, not changed)"; fi
for p in $profiles; do
  before=$(kubectl get gpuprofiles.ai.flexinfer -n "${p%/*}" "${p#*/}" -o json | jq -r --arg f "$format" '.spec.quantization.images[$f] // "(none)"')
  kubectl patch gpuprofiles.ai.flexinfer -n "${p%/*}" "${p#*/}" --type merge -p "$patch" "${dry_flag[@]}" >/dev/null
  say "GPUProfile $p: quantization.images.$format $before -> $image$note"
done

# 4. Move a running quantization onto the new image.
[[ -n $restart ]] || exit 0
anno=flexinfer.ai/force-image-update
if ((dry)); then
  kubectl annotate modelcache.ai.flexinfer -n "$restart_ns" "$restart_name" "$anno=true" --overwrite --dry-run=server >/dev/null
  say "ModelCache $restart: would annotate $anno=true, wait for its quantize Job to run $image, then remove it"
  exit 0
fi
kubectl annotate modelcache.ai.flexinfer -n "$restart_ns" "$restart_name" "$anno=true" --overwrite >/dev/null
say "ModelCache $restart: annotated $anno=true; waiting up to ${wait_s}s for its quantize Job to run the new image"
job=$restart_name-quantize
deadline=$(($(date +%s) + wait_s))
until [[ $(kubectl get job -n "$restart_ns" "$job" -o jsonpath='{.spec.template.spec.containers[0].image}' 2>/dev/null) == "$image" ]]; do
  if (($(date +%s) >= deadline)); then
    say "Job $restart_ns/$job does not run $image after ${wait_s}s (is a quantization running? kubectl describe modelcache -n $restart_ns $restart_name);"
    say "the annotation stays: remove it with kubectl annotate modelcache -n $restart_ns $restart_name $anno-"
    exit 1
  fi
  sleep 2
done
kubectl annotate modelcache.ai.flexinfer -n "$restart_ns" "$restart_name" "$anno-" >/dev/null
say "Job $restart_ns/$job runs $image; annotation removed"
