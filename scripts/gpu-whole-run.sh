#!/usr/bin/env bash
# The whole-run measurement on a card (docs/dev/gptq-device.md, "The calibration forward on the device"): one call on a machine with a GPU measures the whole
# quantization of a generated Llama-3-8B-shaped model (32 layers, hidden 4096, MLP 14336, GQA 32/8, bf16,
# 128 × 2048 calibration tokens, 4-bit g128) with the calibration forward on the device, after the quick card
# check (kernels, parity, and a whole small model with the device forward against the CPU).
#
#   scripts/gpu-whole-run.sh --build-only     # here: release builds of gpu_check and bench_device_run into .gpu-check/
#   scripts/gpu-whole-run.sh                  # there (carry .gpu-check): writes $OUT/ (or $GPU_RUN_OUT)
#
# Steps, each under its own time limit so that the figures come back even when the machine's time runs out:
#   1. the card, driver and libraries (card.json); a VRAM sampler (nvidia-smi every 250 ms, vram.log);
#   2. gpu_check --quick (gpu-check.json, gpu-check.log);
#   3. the 8B whole run with the forward on the device (llama3-8b-device.json, .log);
#   4. with the time left: the 8B shape's first 2 layers on 16 samples with the forward on the device, with it on
#      the CPU (GPTQ_DEVICE_FORWARD=off), and on the CPU alone, side by side (llama3-8b-2l-*.json).
# summary.json gathers each step's figures and the peak VRAM during it. GPU_RUN_BUDGET (seconds, default 560)
# is the whole call's limit.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STAGE=$ROOT/.gpu-check
BUDGET=${GPU_RUN_BUDGET:-560}
START=$(date +%s)

if [[ ${1:-} == --build-only ]]; then
  target=${CARGO_TARGET_DIR:-$ROOT/target}
  (cd "$ROOT" && cargo build --release -p flexinfer-quant --example gpu_check --example bench_device_run >&2) || exit 1
  mkdir -p "$STAGE"
  for b in gpu_check bench_device_run; do
    cp "$target/release/examples/$b" "$STAGE/$b.tmp"
    strip --strip-debug "$STAGE/$b.tmp" 2>/dev/null || true
    mv "$STAGE/$b.tmp" "$STAGE/$b"
  done
  ls -la "$STAGE"
  exit 0
fi

OUT=${GPU_RUN_OUT:-${OUT:-$ROOT/.gpu-run}}
mkdir -p "$OUT"
left() { echo $((BUDGET - ($(date +%s) - START))); }
log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$OUT/steps.log"; }

# shellcheck source=lib/gpu-libs.sh
source "$ROOT/scripts/lib/gpu-libs.sh"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>/dev/null || true
  echo "NVRTC ${FLEXINFER_NVRTC:-none}; cuBLAS ${FLEXINFER_CUBLAS:-none}; cuSOLVER ${FLEXINFER_CUSOLVER:-none}"
  nproc; free -g | head -2
} | tee "$OUT/card.txt"
python3 - "$OUT/card.json" <<'EOF' || true
import json, subprocess, sys, os
q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                   capture_output=True, text=True).stdout.strip().split(", ")
libs = {k: os.environ.get(k, "") for k in ("FLEXINFER_NVRTC", "FLEXINFER_CUBLAS", "FLEXINFER_CUSOLVER")}
json.dump({"card": q[0] if q else None, "driver": q[1] if len(q) > 1 else None,
           "memory_total": q[2] if len(q) > 2 else None, "libraries": libs, "cpus": os.cpu_count()},
          open(sys.argv[1], "w"), indent=2)
EOF

# VRAM used, MiB, every 250 ms, with the time since the start of this script.
(
  while true; do
    echo "$(($(date +%s%N) / 1000000 - START * 1000)) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)"
    sleep 0.25
  done
) >"$OUT/vram.log" 2>/dev/null &
SAMPLER=$!
trap 'kill $SAMPLER 2>/dev/null' EXIT

marks=()
mark() { marks+=("$1 $(($(date +%s%N) / 1000000 - START * 1000))"); }

log "step 2: gpu_check --quick"
mark "gpu_check_start"
GPU_CHECK_BIN=$STAGE/gpu_check GPU_CHECK_JSON=$OUT/gpu-check.json GPU_CHECK_TIMEOUT=120 \
  bash "$ROOT/scripts/gpu-check.sh" --quick >"$OUT/gpu-check.log" 2>&1
log "gpu_check exit $?"
mark "gpu_check_end"
tail -25 "$OUT/gpu-check.log"

# GPU_RUN_SHAPE=small and GPU_RUN_DEVICE=cpu make a dry run of this script on a machine without a card.
SHAPE=${GPU_RUN_SHAPE:-llama3-8b}
DEV=${GPU_RUN_DEVICE:-cuda}
MODEL=${GPU_RUN_MODEL:-/tmp/flexinfer-$SHAPE}
run_bench() { # name timeout args...
  local name=$1 t=$2
  shift 2
  if ((t < 30)); then
    log "$name: skipped (${t} s left)"
    return 1
  fi
  log "$name: $* (limit ${t} s)"
  mark "${name}_start"
  timeout "$t" "$STAGE/bench_device_run" --json "$OUT/$name.json" "$@" >"$OUT/$name.out" 2>"$OUT/$name.log"
  local rc=$?
  mark "${name}_end"
  log "$name exit $rc"
  tail -4 "$OUT/$name.log"
  grep -E '"(whole_run_seconds|peak_rss_mib|ok)"' "$OUT/$name.json" 2>/dev/null
  return $rc
}

log "step 3: the 8B whole run"
# The model is written first (not timed in the run); the run's own figures are in its JSON.
run_bench "$SHAPE-device" $(($(left) - 110)) --shape "$SHAPE" --model "$MODEL" --device "$DEV"

log "step 4: side by side on 2 layers"
two=(--shape "$SHAPE" --layers 2 --samples 16 --model "$MODEL-2l")
run_bench "$SHAPE-2l-device" $(($(left) - 100)) "${two[@]}" --device "$DEV"
run_bench "$SHAPE-2l-cpu-forward" $(($(left) - 60)) "${two[@]}" --device "$DEV" --forward off
run_bench "$SHAPE-2l-cpu" $(($(left) - 5)) "${two[@]}" --device cpu

kill $SAMPLER 2>/dev/null
printf '%s\n' "${marks[@]}" >"$OUT/marks.txt"
python3 - "$OUT" <<'EOF' || true
import json, os, sys
out = sys.argv[1]
vram = []
for line in open(os.path.join(out, "vram.log")):
    p = line.split()
    if len(p) == 2 and p[1].isdigit():
        vram.append((int(p[0]), int(p[1])))
marks = dict((l.split()[0], int(l.split()[1])) for l in open(os.path.join(out, "marks.txt")) if l.strip())
summary = {"card": json.load(open(os.path.join(out, "card.json"))) if os.path.exists(os.path.join(out, "card.json")) else None}
base = min((v for _, v in vram), default=0)
for name in sorted({k.rsplit("_", 1)[0] for k in marks}):
    s, e = marks.get(name + "_start"), marks.get(name + "_end")
    if s is None or e is None:
        continue
    peak = max((v for t, v in vram if s <= t <= e), default=None)
    entry = {"seconds": (e - s) / 1000, "peak_vram_mib": peak, "idle_vram_mib": base}
    j = os.path.join(out, name + ".json")
    if os.path.exists(j):
        try:
            r = json.load(open(j))
            entry.update({k: r.get(k) for k in ("ok", "error", "device", "whole_run_seconds", "peak_rss_mib", "phases", "shape", "calibration")})
        except Exception as ex:
            entry["json_error"] = str(ex)
    summary[name] = entry
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
print(json.dumps(summary, indent=1)[:6000])
EOF
log "done"
